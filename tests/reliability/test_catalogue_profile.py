"""Profiles that cannot be trusted: a host that other jobs keep busy while `helmc profile` measures, and figures
that would make the planner promise a negative time. A busy window is measured again and, when every window is
busy, refused in one line; a profile whose calibrated deltas are as negative as the bounds allow still gives a plan
with no negative predicted time; a hardware.json that is a FIFO is refused before it is opened."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cli_check import cli, refused
from helmc.errors import HelmcError
from helmc.hardware.host_load import counters, host_load, load_average, measure_on_quiet_host

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


@pytest.fixture
def busy_host():
    """Every CPU of the machine kept busy by other processes (spinning Python) for as long as the test runs."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=60)]) for _ in range(os.cpu_count() or 2)]
    time.sleep(0.3)
    yield
    for p in procs:
        p.kill()
        p.wait()


def _measure(host_hardware, windows: list):
    def once():
        windows.append(time.monotonic())
        time.sleep(1.0)                 # the window: this process idle, the spinners running
        return host_hardware
    return once


def test_busy_window_is_seen(busy_host):
    before, start = load_average(), counters()
    time.sleep(1.0)
    load = host_load(start, counters(), os.cpu_count() or 2, before)
    assert load is not None and load.busy and load.others_cores > 0.5, load


def test_own_work_is_not_counted_as_others():
    """What this process spends is its own ticks, taken off the machine's busy time: they match its CPU time."""
    start, cpu0 = counters(), time.process_time()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
    stop, cpu1 = counters(), time.process_time()
    own = (stop.own_ticks - start.own_ticks) / os.sysconf("SC_CLK_TCK")
    assert cpu1 - cpu0 > 0.05 and abs(own - (cpu1 - cpu0)) <= 0.05, (own, cpu1 - cpu0)
    assert stop.busy_ticks - start.busy_ticks >= stop.own_ticks - start.own_ticks - 5


def test_profile_on_a_busy_host_is_refused(busy_host, host_hardware):
    windows = []
    with pytest.raises(HelmcError) as e:
        measure_on_quiet_host(_measure(host_hardware, windows), os.cpu_count() or 2, attempts=2, pause_s=0.1)
    assert len(windows) == 2                               # measured again before refusing
    text = str(e.value)
    assert "expected an idle host, found it busy in 2 measurements" in text and "\n" not in text


def test_quick_profile_on_a_busy_host_keeps_a_note(busy_host, host_hardware):
    windows = []
    hw = measure_on_quiet_host(_measure(host_hardware, windows), os.cpu_count() or 2, quick=True)
    assert len(windows) == 1 and "host load: busy while measuring" in hw.notes[-1]


def test_negative_deltas_never_give_a_negative_time(tiny, hw_json, workdir):
    """Calibrated deltas as negative as a profile may hold (a profile from a slower machine): every time in the plan,
    its candidates' too, is >= 0."""
    d = json.loads(hw_json.read_text())
    d["cpu"].update(block_overhead_ms=-999.0, step_overhead_ms=-999.0)
    hw_json.write_text(json.dumps(d))
    model, _ = tiny.model("qwen3")
    out = workdir / "plan.json"
    r = cli("plan", model, hw_json, "-o", out)
    assert r.exit_code == 0, r.output
    plan = json.loads(out.read_text())
    rows = [plan["predictions"]] + plan["predictions"]["candidates"]
    times = [row[k] for row in rows for k in ("t_cpu_ms", "t_gpu_ms", "t_comm_ms", "t_plan_ms")]
    assert len(times) > 4 and min(times) >= 0, times
    assert "T_plan -" not in r.stdout and "T_plan" in r.stdout, r.stdout


def test_hardware_json_fifo_is_refused_without_blocking(tiny, tmp_path, workdir):
    fifo = tmp_path / "hw.json"
    os.mkfifo(fifo)
    model, _ = tiny.model("qwen3")
    helmc = os.path.join(os.path.dirname(sys.executable), "helmc")
    r = subprocess.run([helmc, "plan", model, str(fifo)], capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.startswith("helmc:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "expected a regular file, found a FIFO" in lines[0]
