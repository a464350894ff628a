"""What a long command is doing, on stderr through rich: a line per phase (with the time since the start) and a bar
for counted work (blocks bound, tensors quantized) that redraws in place instead of a line per item. Nothing at all
when quiet (--json) or when stderr is not a terminal (a log, a pipe, a test): the results say what was done.

    p = Progress(quiet)
    p("read_model: Qwen3, 36 layers")            # a phase line
    with steps(p, "binding weights", 36) as bar:  # any progress callable; a bar only for a live Progress
        for ...: bar.advance()
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, quiet: bool = False, stream=None):
        stream = stream or sys.stderr
        self.live = not quiet and stream.isatty()
        self.t0 = time.perf_counter()
        self._console = None
        if self.live:
            from rich.console import Console
            self._console = Console(file=stream, highlight=False)

    def __call__(self, msg: str) -> None:
        if self.live:
            self._console.print(f"{time.perf_counter() - self.t0:6.1f}s  {msg.strip()}", markup=False)

    @contextmanager
    def bar(self, description: str, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bars, TextColumn, TimeElapsedColumn
        with Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=self._console, transient=True) as bars:
            task = bars.add_task(description, total=total)
            yield _Counter(lambda: bars.advance(task))
        self(f"{description}: {total} done")


class _Counter:
    def __init__(self, advance=lambda: None):
        self._advance = advance

    def advance(self) -> None:
        self._advance()


@contextmanager
def steps(progress, description: str, total: int):
    """A bar of `total` steps where `progress` is a live Progress; else a counter that says nothing (a plain callable,
    quiet, or not a terminal)."""
    if isinstance(progress, Progress) and progress.live and total > 1:
        with progress.bar(description, total) as counter:
            yield counter
    else:
        yield _Counter()
