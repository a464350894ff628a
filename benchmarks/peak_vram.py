"""Peak VRAM over a stretch of work: one sampler, fed by a source that reads the device's used bytes now.

    with PeakVram(cuda_used_bytes(torch.cuda.mem_get_info), baseline_bytes) as vram: work()
    vram.peak_gib       # GiB above baseline_bytes, to 3 decimals

    with smi_peak_vram() as vram: run_peer()
    vram.held_gib       # GiB above what was in use when it began; None without nvidia-smi

Two sources: cudaMemGetInfo in this process (cuda_used_bytes: the whole device's use, other processes included),
and nvidia-smi printing GPU 0's used memory every 100 ms (nvidia_smi_stream: for a peer process, whose VRAM is not
in its own output). A source is any callable returning bytes in use, or None where nothing can tell; one that must
start something first (a process) is also a context manager, entered for each `with` of the sampler.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from typing import Callable, Protocol

GIB = 1024 ** 3
MIB = 1024 ** 2
SMI_QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]


class UsedBytes(Protocol):
    def __call__(self) -> int | None:
        """The device's used bytes now; None where nothing can tell."""


class PeakVram:
    """Reads `source` on entry, every `period_s` in a thread, and on exit; peak is the most seen. The baseline is
    `baseline_bytes`, or where that is None the first reading of each `with`. Entered again, it starts afresh."""

    def __init__(self, source: UsedBytes, baseline_bytes: int | None = None, period_s: float = 0.02):
        self.source, self.period, self._baseline_arg = source, period_s, baseline_bytes
        self.baseline, self.peak = baseline_bytes, None
        self._stop = threading.Event()
        self._thread = None
        self._opened = contextlib.ExitStack()

    def _take(self, used: int | None) -> None:
        if used is not None:
            self.peak = used if self.peak is None else max(self.peak, used)

    def __enter__(self) -> "PeakVram":
        if hasattr(self.source, "__enter__"):
            self._opened.enter_context(self.source)
        self.peak = None
        try:
            first = self.source()
        except BaseException:                    # a started source (a process) is not left running
            self._opened.close()
            raise
        self.baseline = first if self._baseline_arg is None else self._baseline_arg
        self._take(first)
        self._stop.clear()
        self._thread = None
        if first is not None:                    # a source that cannot tell now is not asked again
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._take(self.source())
            except Exception:                    # the device went away mid-run: keep what was seen
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._opened.close()                     # a stream source hands over what it printed up to its end
        if self._thread is not None:
            self._take(self.source())

    @property
    def held_bytes(self) -> int | None:
        """The peak above the baseline (never below 0); None where either went unread."""
        if self.peak is None or self.baseline is None:
            return None
        return max(0, self.peak - self.baseline)

    @property
    def held_gib(self) -> float | None:
        held = self.held_bytes
        return None if held is None else held / GIB

    @property
    def peak_gib(self) -> float | None:
        held = self.held_bytes
        return None if held is None else round(held / GIB, 3)


def cuda_used_bytes(mem_get_info: Callable[[], tuple[int, int]]) -> UsedBytes:
    """A source from a (free, total) reader: torch.cuda.mem_get_info or cupy.cuda.runtime.memGetInfo."""
    def used() -> int:
        free, total = mem_get_info()
        return total - free
    return used


def gpu_memory_used_mib() -> int | None:
    """GPU 0's used memory as nvidia-smi reports it once, in MiB; None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(SMI_QUERY, stdout=subprocess.PIPE, text=True).stdout.split()
    return int(out[0]) if out else None


class PrintedUsedBytes:
    """Used memory from a process printing it, one number of `unit` bytes a line: a reading is the most it printed
    since the last reading (a spike between two readings is not lost), else the last value it printed; the first,
    before it printed any, is `first()`. Where `first()` is None the process is not started and every reading is
    None. On exit the process is ended and what it printed up to then is the next reading."""

    def __init__(self, command: list[str], first: Callable[[], int | None], unit: int = 1):
        self.command, self.first, self.unit = command, first, unit
        self._proc, self._latest, self._pending = None, None, b""

    def __enter__(self) -> "PrintedUsedBytes":
        first = self.first()
        self._latest, self._pending, self._proc = None if first is None else first * self.unit, b"", None
        if first is not None:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE)
            os.set_blocking(self._proc.stdout.fileno(), False)
        return self

    def __call__(self) -> int | None:
        if self._proc is not None and not self._proc.stdout.closed:
            try:
                while chunk := os.read(self._proc.stdout.fileno(), 65536):
                    self._pending += chunk
            except BlockingIOError:                          # nothing more printed yet
                pass
        *lines, self._pending = self._pending.split(b"\n")
        values = [int(v) * self.unit for v in lines if v.strip().isdigit()]
        if not values:
            return self._latest
        self._latest = values[-1]
        return max(values)

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        fd = self._proc.stdout.fileno()
        os.set_blocking(fd, True)
        while chunk := os.read(fd, 65536):                   # what it printed up to its end
            self._pending += chunk
        self._proc.stdout.close()
        self._proc.wait()
        self._pending += b"\n"


def nvidia_smi_stream(period_ms: int = 100) -> PrintedUsedBytes:
    """GPU 0's used memory as nvidia-smi prints it every `period_ms` (a one-off query before its first line)."""
    return PrintedUsedBytes(SMI_QUERY + ["-lms", str(period_ms)], gpu_memory_used_mib, unit=MIB)


def smi_peak_vram() -> PeakVram:
    """A peer process's peak VRAM: nvidia-smi's samples over the run, less the memory in use when it began."""
    return PeakVram(nvidia_smi_stream(), baseline_bytes=None, period_s=0.1)
