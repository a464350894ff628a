"""benchmarks/peak_vram.py: the sampler's arithmetic over a source's readings (a stand-in source: the readings are its
input), a printing process read without losing a value, and nvidia-smi's absence."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from benchmarks.peak_vram import GIB, MIB, PeakVram, PrintedUsedBytes, cuda_used_bytes, smi_peak_vram


class Readings:
    """Hands out the given readings in turn, then repeats the last; `wait` holds the one at `hold` until released,
    so a reading taken by the sampler's thread is known to have happened."""

    def __init__(self, values, hold: int | None = None):
        self.values, self.taken, self.hold = list(values), 0, hold
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self):
        i = min(self.taken, len(self.values) - 1)
        self.taken += 1
        if i == self.hold:
            self.reached.set()
            self.release.wait(5)
        return self.values[i]


def test_the_peak_above_a_given_baseline_counts_the_thread_readings():
    src = Readings([2 * GIB, int(3.5 * GIB), 3 * GIB], hold=2)
    with PeakVram(src, baseline_bytes=GIB, period_s=0.001) as vram:
        assert src.reached.wait(5)                   # the thread took the 3.5 GiB reading and waits on the third
        src.release.set()
    assert vram.peak == int(3.5 * GIB) and vram.baseline == GIB
    assert vram.held_bytes == int(2.5 * GIB) and vram.peak_gib == 2.5 and vram.held_gib == 2.5


def test_peak_gib_is_rounded_and_never_below_the_baseline():
    with PeakVram(Readings([GIB + 123_456_789]), baseline_bytes=GIB, period_s=60) as vram:
        pass
    assert vram.peak_gib == round(123_456_789 / GIB, 3) == 0.115
    assert vram.held_gib == pytest.approx(123_456_789 / GIB)
    with PeakVram(Readings([GIB // 2]), baseline_bytes=GIB, period_s=60) as low:
        pass
    assert low.held_bytes == 0 and low.peak_gib == 0.0


def test_without_a_baseline_the_first_reading_is_it_and_each_entry_starts_afresh():
    src = Readings([4 * GIB, 6 * GIB, 5 * GIB, 5 * GIB])
    vram = PeakVram(src, period_s=60)              # no thread reading: entry and exit only
    with vram:
        pass
    assert (vram.baseline, vram.peak, vram.held_gib) == (4 * GIB, 6 * GIB, 2.0)
    with vram:
        pass
    assert (vram.baseline, vram.peak, vram.held_gib) == (5 * GIB, 5 * GIB, 0.0)


def test_a_source_that_cannot_tell_leaves_the_figures_unknown():
    src = Readings([None, 9 * GIB])
    with PeakVram(src, period_s=0.001) as vram:
        pass
    assert src.taken == 1                           # not asked again: no thread, no reading on exit
    assert vram.held_bytes is None and vram.held_gib is None and vram.peak_gib is None


def test_cuda_source_is_total_less_free():
    assert cuda_used_bytes(lambda: (3 * GIB, 8 * GIB))() == 5 * GIB


# A process printing the given chunks one at a time: after each, it marks it printed and waits for the test's go.
STEPPER = """
import os, sys, time
d, chunks = sys.argv[1], sys.argv[2:]
for i, chunk in enumerate(chunks):
    sys.stdout.write(chunk.replace("/", "\\n")); sys.stdout.flush()
    open(os.path.join(d, f"printed{i}"), "w").close()
    while not os.path.exists(os.path.join(d, f"go{i}")):
        time.sleep(0.01)
time.sleep(60)
"""


class Stepper:
    def __init__(self, tmp_path, chunks: list[str], first=lambda: 1, unit: int = 1):
        self.dir = tmp_path
        self.source = PrintedUsedBytes([sys.executable, "-c", STEPPER, str(tmp_path), *chunks], first, unit)

    def printed(self, i: int) -> None:
        deadline = time.monotonic() + 60
        while not (self.dir / f"printed{i}").exists():
            assert time.monotonic() < deadline, f"the printing process did not print chunk {i}"
            time.sleep(0.01)

    def go(self, i: int) -> None:
        (self.dir / f"go{i}").touch()


def test_a_reading_is_the_most_printed_since_the_last_and_a_partial_line_waits(tmp_path):
    step = Stepper(tmp_path, ["5/8/6/1", "2/", "30/"])
    with step.source as printed:
        assert printed() == 1                       # nothing printed yet: the first reading
        step.printed(0)
        assert printed() == 8                       # 5, 8, 6: the most since the last reading; "1" is no line yet
        assert printed() == 6                       # nothing new: the last value printed
        step.go(0)
        step.printed(1)
        assert printed() == 12                      # "1" and "2/" make one line
        step.go(1)
        step.printed(2)
        assert printed() == 30


def test_the_sampler_keeps_what_a_printing_process_printed_up_to_its_end(tmp_path):
    step = Stepper(tmp_path, ["3/7/4/", "9/"], first=lambda: 2, unit=MIB)
    with PeakVram(step.source, period_s=60) as vram:   # no thread reading: the 9 comes only with the exit's
        step.printed(0)
        step.go(0)
        step.printed(1)
    assert vram.baseline == 2 * MIB and vram.peak == 9 * MIB and vram.held_gib == 7 / 1024
    assert step.source._proc.returncode is not None    # ended on exit


def test_a_printing_process_is_not_started_where_the_first_reading_is_none(tmp_path):
    step = Stepper(tmp_path, ["5/"], first=lambda: None)
    with PeakVram(step.source, period_s=0.001) as vram:
        pass
    assert step.source._proc is None and vram.held_gib is None


def test_without_nvidia_smi_the_peer_figure_is_none(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))       # an empty directory: no nvidia-smi on the path
    with smi_peak_vram() as vram:
        pass
    assert vram.held_gib is None
