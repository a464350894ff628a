"""Progress on stderr (runtime/progress.py): a bar for counted work, not a line per item; nothing when quiet or when
the stream is not a terminal."""
from __future__ import annotations

import io

from helmc.runtime.progress import Progress, steps


class Terminal(io.StringIO):
    """A text stream that says it is a terminal (what rich and Progress ask before drawing)."""

    def isatty(self) -> bool:
        return True


def run(progress):
    progress("read_model: Qwen3ForCausalLM, 47 tensors")
    with steps(progress, "quantize: 47 tensors to q4_k", 47) as bar:
        for _ in range(47):
            bar.advance()


def test_a_terminal_gets_phase_lines_and_one_line_for_the_counted_work():
    out = Terminal()
    run(Progress(stream=out))
    text = out.getvalue()
    assert "read_model: Qwen3ForCausalLM, 47 tensors" in text
    assert text.count("quantize: 47 tensors to q4_k: 47 done") == 1
    assert "47/47" in text                          # the bar was drawn (in place, then cleared)


def test_quiet_or_not_a_terminal_says_nothing():
    for out, quiet in ((Terminal(), True), (io.StringIO(), False)):
        p = Progress(quiet=quiet, stream=out)
        run(p)
        assert not p.live and out.getvalue() == ""
    seen = []
    run(seen.append)                       # a plain callable: its phase lines, no line per tensor
    assert seen == ["read_model: Qwen3ForCausalLM, 47 tensors"]
