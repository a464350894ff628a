"""DRAM and PCIe at once: the rates hybrid decode gets when the CPU and the DMA engine read host memory together.

Hybrid decode copies streamed blocks' weights from pinned host memory to the GPU while helmc's CPU stage reads its
own blocks. Both streams come out of the same memory controllers, so the rates measured alone (cpu.host_read_gbs,
link.h2d_gbs) do not add up: what each gets while the other runs is measured here, in one window.

  1. alone: helmc's fp16 decode GEMVs (host_read.GemvPass) with nothing else; the copies with nothing else;
  2. together: host -> device copies of `chunk` bytes (rotating over a pinned buffer larger than the L3) are queued
     on a stream of their own, an event after each, and the GEMV passes run on every core until the last copy is
     done. The window is [first GEMV pass start, min(last copy end, last GEMV pass end)]; each side's rate is its
     bytes wholly inside the window over the span they took (copy end times come from the events, placed on the
     host clock by an event recorded on the idle stream just before).

The median of `trials` windows (by combined rate) is kept; each side alone is measured before every window and its
figure is the median over all of them, so a burst of a slow host lands in one of several (measured: the GEMVs
alone 14.3 GB/s in their 0.1 s, 86.6 in the windows after). An alone rate below what the same run measured of it
(the profile's GEMV pass, the link alone) or below its own rate in the windows is measured again
(host_read.recheck); a window whose two rates add up to less than the faster side alone is taken again
(window_plausible), after the GEMVs first settle at their earlier rate (settle). Needs CuPy (the backend's queue_h2d), the TVM runtime and the profile kit; the arithmetic
(window_rates) is plain Python.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ConcurrentRates:
    cpu_alone_gbs: float
    h2d_alone_gbs: float
    cpu_gbs: float                    # the GEMVs' read rate while the copies run
    h2d_gbs: float                    # the copies' rate while the GEMVs run
    window_s: float
    doubtful: tuple[str, ...] = ()    # alone rates implausible even when measured again (host_read.recheck)

    @property
    def combined_gbs(self) -> float:
        return self.cpu_gbs + self.h2d_gbs


def window_rates(passes: list[tuple[float, float]], pass_bytes: int, copy_start: float, copy_ends: list[float],
                 chunk: int) -> tuple[float, float, float]:
    """(CPU GB/s, copy GB/s, window seconds) over the window where both ran.

    passes: (start, end) host times of the GEMV passes, in order; copy_ends: host times at which each copy ended,
    in order, the first having started at copy_start. Raises ValueError when the window holds fewer than two
    passes or three copies (too short to say anything)."""
    if not passes or not copy_ends:
        raise ValueError("concurrent window: expected GEMV passes and copies, found none")
    start = passes[0][0]
    end = min(copy_ends[-1], passes[-1][1])
    inside = [(s, e) for s, e in passes if e <= end]
    starts = [copy_start] + copy_ends[:-1]
    copies = [(s, e) for s, e in zip(starts, copy_ends) if s >= start and e <= inside[-1][1]] if inside else []
    if len(inside) < 2 or len(copies) < 3:
        raise ValueError(f"concurrent window: expected >= 2 GEMV passes and >= 3 copies while both ran, found "
                         f"{len(inside)} and {len(copies)} (the copies or the passes were too short)")
    cpu = len(inside) * pass_bytes / (inside[-1][1] - start) / 1e9
    h2d = len(copies) * chunk / (copies[-1][1] - copies[0][0]) / 1e9
    return cpu, h2d, inside[-1][1] - start


# Sharing one memory, the two sides together move at least about what the faster one moves alone; a window below
# this share of it was taken in a disturbance of the host (measured: 29.3 + 53.5 GB/s at once beside
# GEMVs that read 96.5 alone a second later; the plans made from it overestimated hybrid tokens by 1.35x).
WINDOW_PLAUSIBLE_SHARE = 0.9
# Before the first window the GEMVs run until they reach this share of their rate measured earlier in the run (or
# for SETTLE_S at most): the window's pinned buffers were just allocated, and the passes right after read at a
# fraction of it (measured: 14.3 GB/s in two runs, ~90 in the windows after).
SETTLE_SHARE, SETTLE_S = 0.75, 5.0


def window_plausible(cpu_gbs: float, h2d_gbs: float, cpu_alone_gbs: float, h2d_alone_gbs: float) -> bool:
    """Whether a window's two rates add up to at least WINDOW_PLAUSIBLE_SHARE of the faster side alone."""
    return cpu_gbs + h2d_gbs >= WINDOW_PLAUSIBLE_SHARE * max(cpu_alone_gbs, h2d_alone_gbs)


def settle(gemv, target_gbs: float, seconds: float = SETTLE_S) -> float:
    """Run GEMV passes until one reads >= target_gbs or `seconds` pass; -> the last pass's GB/s."""
    end, gbs = time.perf_counter() + seconds, 0.0
    while True:
        t0 = time.perf_counter()
        gemv.run()
        gbs = gemv.nbytes / (time.perf_counter() - t0) / 1e9
        if gbs >= target_gbs or time.perf_counter() >= end:
            return gbs


def _copies_alone_gbs(be, dev, host, host_bytes: int, chunk: int, count: int) -> float:
    handle = be.queue_h2d(dev, host, host_bytes, chunk, count)
    ends = be.copy_end_times(handle)
    return (count - 1) * chunk / (ends[-1] - ends[0]) / 1e9


def measure_concurrent(be, gemv, h2d_gbs_hint: float, seconds: float = 1.5, chunk: int = 256 << 20,
                       host_bytes: int = 1 << 30, trials: int = 3, progress=lambda m: None,
                       cpu_gbs_hint: float = 0.0) -> ConcurrentRates:
    """gemv: an object with run() (one pass of helmc's fp16 decode GEMVs) and nbytes; h2d_gbs_hint: the link's
    rate alone, to size the queue of copies to about `seconds`; cpu_gbs_hint: the same GEMVs' rate measured
    earlier in the run (0: none), which their rate alone here cannot be far below."""
    from helmc.hardware.host_read import RETRIES, RETRY_PAUSE_S, median_gbs, recheck
    host = be.pinned(host_bytes)
    dev = be.full((chunk,), 0, "uint8")
    # The copies are queued longer than the GEMVs need (contention slows them), each trial at least `seconds`.
    count = max(8, int(1.5 * seconds * h2d_gbs_hint * 1e9 / chunk))
    progress(f"DRAM + PCIe: {trials} windows of the GEMVs and copies to the GPU at once, each side alone before each")

    def cpu_alone() -> list[float]:
        return median_gbs(gemv.nbytes, gemv.run, 5)[1]

    def h2d_alone() -> float:
        return _copies_alone_gbs(be, dev, host, host_bytes, chunk, max(8, count // 4))
    if cpu_gbs_hint:
        settle(gemv, SETTLE_SHARE * cpu_gbs_hint)

    def window() -> tuple[float, float, float]:
        handle = be.queue_h2d(dev, host, host_bytes, chunk, count)
        copy_start = handle[1]
        passes = []
        while not be.copies_done(handle) or len(passes) < 2:
            t = time.perf_counter()
            gemv.run()
            passes.append((t, time.perf_counter()))
        return window_rates(passes, gemv.nbytes, copy_start, be.copy_end_times(handle), chunk)
    results, cpu_rates, h2d_rates, retries, doubt_window = [], [], [], 0, ""
    for _ in range(trials):
        alone = cpu_alone()
        cpu_rates += alone
        h2d_rates.append(h2d_alone())
        r = window()
        while not window_plausible(r[0], r[1], max(alone), h2d_rates[-1]) and retries < RETRIES:
            retries += 1
            progress(f"DRAM + PCIe: a window of {r[0]:.1f} + {r[1]:.1f} GB/s is implausible beside {max(alone):.1f} "
                     f"and {h2d_rates[-1]:.1f} GB/s alone: measuring it again ({retries} of {RETRIES})")
            time.sleep(RETRY_PAUSE_S)
            alone = cpu_alone()
            r = window()
        if not window_plausible(r[0], r[1], max(alone), h2d_rates[-1]):
            doubt_window = (f"the DRAM + PCIe window {r[0]:.1f} + {r[1]:.1f} GB/s stayed below "
                            f"{WINDOW_PLAUSIBLE_SHARE:.2f} x the faster side alone after {RETRIES} more windows")
        results.append(r)
    cpu, h2d, window_s = sorted(results, key=lambda r: r[0] + r[1])[len(results) // 2]
    # Contention only slows a side: alone it reads at least what it read in the window, and what it read earlier.
    cpu_solo, doubt_cpu = recheck("the window's GEMVs alone", statistics.median(cpu_rates), max(cpu, cpu_gbs_hint),
                                  lambda: statistics.median(cpu_alone()), progress)
    h2d_solo, doubt_h2d = recheck("the window's copies alone", statistics.median(h2d_rates), max(h2d, h2d_gbs_hint),
                                  h2d_alone, progress)
    progress(f"DRAM + PCIe: alone the GEMVs read {cpu_solo:.1f} GB/s and the copies move {h2d_solo:.1f} GB/s; at once "
             f"{cpu:.1f} + {h2d:.1f} GB/s")
    return ConcurrentRates(round(cpu_solo, 2), round(h2d_solo, 2), round(cpu, 2), round(h2d, 2), round(window_s, 3),
                           tuple(d for d in (doubt_cpu, doubt_h2d, doubt_window) if d))
