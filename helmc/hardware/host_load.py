"""Is the host busy? What other processes took of the CPUs while `helmc profile` measured.

A profile measured while another job used the cores reads DRAM and the GEMVs far below what the idle machine gives
(53.6 GB/s where the idle host read 94.8), and a plan made from it is slow. The kernel's counters say how much CPU
time everybody else took: the busy time of every CPU in /proc/stat less this process's own (its threads and
waited-for children, /proc/self/stat), over the window, in logical CPUs of the whole machine (a job on CPUs this
process may not use still shares its memory bandwidth). The 1-minute load average before the window
says whether a job was already running.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Other processes' share of the allowed cores above which a window is busy: a quarter of the cores (on 2 cores, half
# a core of someone else's work) and at least 0.3 of a core (the idle host's daemons take a few hundredths).
BUSY_SHARE = 0.25
BUSY_FLOOR_CORES = 0.3


@dataclass(frozen=True)
class CpuCounters:
    wall_s: float
    busy_ticks: int          # every CPU's non-idle time, in clock ticks
    own_ticks: int           # this process's (its threads and waited-for children)


@dataclass(frozen=True)
class HostLoad:
    """Over one window: the cores other processes kept busy on average, and the load average before it."""
    others_cores: float
    load_before: float
    cores: int
    seconds: float

    @property
    def busy(self) -> bool:
        return self.others_cores > max(BUSY_FLOOR_CORES, BUSY_SHARE * self.cores)

    def describe(self) -> str:
        return (f"other processes kept {self.others_cores:.2f} of {self.cores} cores busy over {self.seconds:.1f} s "
                f"(1-minute load average before: {self.load_before:.2f})")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def counters() -> CpuCounters | None:
    """The CPU counters now; None where /proc does not give them (then nothing is judged busy)."""
    stat, own = _read("/proc/stat"), _read("/proc/self/stat")
    if not stat.startswith("cpu ") or not own:
        return None
    v = [int(x) for x in stat.splitlines()[0].split()[1:]]
    busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0)         # all but idle and iowait
    if len(v) > 8:
        busy -= sum(v[8:10])                                   # guest time is counted in user already
    fields = own.rsplit(")", 1)[1].split()                     # after the command name, which may hold spaces
    mine = sum(int(x) for x in fields[11:15])                  # utime, stime, cutime, cstime
    return CpuCounters(time.monotonic(), busy, mine)


def load_average() -> float:
    text = _read("/proc/loadavg").split()
    return float(text[0]) if text else 0.0


def host_load(start: CpuCounters | None, end: CpuCounters | None, cores: int, load_before: float) -> HostLoad | None:
    """Other processes' CPU use between two counters() readings, or None where either is missing."""
    if start is None or end is None or end.wall_s <= start.wall_s:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    others = max(0, (end.busy_ticks - start.busy_ticks) - (end.own_ticks - start.own_ticks)) / tick
    seconds = end.wall_s - start.wall_s
    return HostLoad(others / seconds, load_before, max(1, cores), seconds)


def sample(seconds: float, cores: int) -> HostLoad | None:
    """Others' CPU use over the next `seconds` (this process idle meanwhile)."""
    before, start = load_average(), counters()
    time.sleep(seconds)
    return host_load(start, counters(), cores, before)


def measure_on_quiet_host(measure_once, cores: int, quick: bool = False, progress=lambda m: None,
                          attempts: int = 3, pause_s: float = 10.0):
    """measure_once()'s profile from a window in which other processes left the cores alone. A busy window is
    measured again after a pause, up to `attempts` windows; if every one was busy, a HelmcError says so (the rates
    would be too low, and plans made from them slow). quick (tests, figures not fit for planning): the first window
    is kept, with a note that the host was busy."""
    import dataclasses

    from helmc.errors import HelmcError
    load = None
    for attempt in range(attempts):
        before, start = load_average(), counters()
        hw = measure_once()
        load = host_load(start, counters(), cores, before)
        if load is None or not load.busy:
            if attempt:
                hw = dataclasses.replace(hw, notes=tuple(hw.notes) + (
                    f"host load: measured again after {attempt} busy window(s); this window: "
                    f"{load.describe() if load else 'not known'}",))
            return hw
        if quick:
            return dataclasses.replace(hw, notes=tuple(hw.notes) + (
                f"host load: busy while measuring ({load.describe()}); the rates may be low",))
        progress(f"host busy: {load.describe()}; measuring again in {pause_s:g} s")
        time.sleep(pause_s)
    raise HelmcError(f"profile: expected an idle host, found it busy in {attempts} measurements ({load.describe()}); "
                     f"its rates would be too low and plans made from them slow: stop the other jobs and run "
                     f"`helmc profile` again")
