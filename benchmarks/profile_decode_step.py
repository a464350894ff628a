#!/usr/bin/env python3
"""Per-kernel timing of one decode step of a bundle with a GPU stage, on the GPU machine.

    python -m benchmarks.profile_decode_step BUNDLE --weights MODEL [--ncu /usr/local/cuda/bin/ncu]
        [--prompt-len 128] [--steps 64] [--out step.json]

First, without a profiler: the wall time per decode step over --steps steps (CUDA graph replays once the page
table is stable), and the GPU time of the same steps from CUDA events on the session's stream; the same steps as
greedy decoding runs them (argmax on the GPU); and the captured step's graph replayed back to back, with no host
work between (their difference is what the token loop's host work costs the step). Then, with
--ncu, the script runs itself under Nsight Compute (`--profile-from-start off`: only one decode step, between
cudaProfilerStart/Stop, is profiled; graph nodes one by one) and reads each kernel's gpu__time_duration.
The table: kernels grouped by name, count, total microseconds, share of the step; the sum of kernel times
against the step's wall time is what the step spends outside kernels (launch gaps, host work).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_and_warm(bundle: str, weights: str, prompt_len: int):
    from helmc.runtime.session import Session
    s = Session.load(bundle, weights_dir=weights)
    if s.gpu is None:
        raise SystemExit(f"{bundle}: the plan has no GPU stage")
    prompt = np.random.default_rng(0).integers(3, min(s.spec.vocab_size, 32000), prompt_len).tolist()
    r = s.generate(prompt_ids=prompt, max_new_tokens=8, stop_at_eos=False)   # prefill, then graph capture
    return s, r.tokens[-1]


def timed_steps(s, tok: int, steps: int, cprofile: str | None = None) -> dict:
    import cupy as cp
    stream = s.gpu.stream
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    t = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(s.forward([tok])[-1]))
    wall_ms = 1e3 * (time.perf_counter() - t) / steps
    end.record(stream)
    end.synchronize()
    stream_ms = cp.cuda.get_elapsed_time(start, end) / steps
    t = time.perf_counter()
    for _ in range(steps):                  # the greedy token loop's step: the argmax on the GPU, 8 bytes back
        tok = s.forward([tok], argmax=True)
    greedy_ms = 1e3 * (time.perf_counter() - t) / steps
    if cprofile:                            # where the host's share of those steps goes (cProfile's own cost added)
        import cProfile
        import pstats
        prof = cProfile.Profile()
        for _ in range(steps):
            tok = prof.runcall(s.forward, [tok], argmax=True)
        with open(cprofile, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(30)
    graph = s.gpu.decode_graph
    replay_ms = None
    if graph is not None and graph.graph is not None:
        # the captured step alone, replayed back to back (it rewrites the same KV row with the same values): what a
        # step costs the GPU with no host work between steps
        stream.synchronize()
        start.record(stream)
        for _ in range(steps):
            graph.graph.launch(stream)
        end.record(stream)
        end.synchronize()
        replay_ms = cp.cuda.get_elapsed_time(start, end) / steps
    return {"wall_ms_per_step": wall_ms, "stream_ms_per_step": stream_ms, "greedy_wall_ms_per_step": greedy_ms,
            "graph_replay_ms_per_step": replay_ms,
            "graph": None if graph is None else {"replays": graph.replays, "captures": graph.captures,
                                                 "eager": graph.eager_steps, "disabled": graph.disabled},
            "last_token": tok}


def inner(a) -> int:
    import cupy as cp
    s, tok = load_and_warm(a.bundle, a.weights, a.prompt_len)
    timed_steps(s, tok, 4)                                   # the graph for this page table is captured
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    s.forward([tok])
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    return 0


def parse_ncu(text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) per profiled kernel from ncu's --csv output."""
    lines = text[text.index('"ID"'):] if '"ID"' in text else text
    out = []
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    for row in csv.DictReader(io.StringIO(lines)):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            out.append((row["Kernel Name"], value * scale.get(row.get("Metric Unit", "nsecond"), 1e-3)))
    return out


def kernel_table(kernels: list[tuple[str, float]], step_us: float) -> list[dict]:
    by = defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        short = name.split("(")[0][:60]
        by[short][0] += 1
        by[short][1] += us
    rows = [{"kernel": k, "count": c, "total_us": t, "share_of_step": t / step_us} for k, (c, t) in by.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ncu", default=None, help="Nsight Compute's ncu: per-kernel times of one step")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cprofile", default=None, help="write cProfile's view of the greedy steps' host work here")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.inner:
        return inner(a)
    s, tok = load_and_warm(a.bundle, a.weights, a.prompt_len)
    report = {"bundle": a.bundle, "plan": s.plan.describe(), **timed_steps(s, tok, a.steps, a.cprofile)}
    replay = report["graph_replay_ms_per_step"]
    print(f"{a.bundle} ({report['plan']}): {report['wall_ms_per_step']:.3f} ms per step (wall, logits to the host), "
          f"{report['stream_ms_per_step']:.3f} ms on the stream; greedy (argmax on the GPU) "
          f"{report['greedy_wall_ms_per_step']:.3f} ms; the captured step replayed back to back "
          f"{'-' if replay is None else f'{replay:.3f}'} ms; graph {report['graph']}", flush=True)
    del s
    if a.ncu:
        # no clock locking or cache flushing: the kernels run as in the timed step (ncu's defaults lock the
        # clocks to base and flush caches between kernels, which inflated a per-kernel table by ~30%)
        cmd = [a.ncu, "--profile-from-start", "off", "--graph-profiling", "node", "--clock-control", "none",
               "--cache-control", "none", "--metrics",
               "gpu__time_duration.sum", "--csv", sys.executable, "-m", "benchmarks.profile_decode_step", a.bundle,
               "--weights", a.weights, "--prompt-len", str(a.prompt_len), "--inner"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=_ROOT)
        kernels = parse_ncu(p.stdout)
        if not kernels:
            print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
            raise SystemExit(f"ncu: no kernel times found (rc {p.returncode})")
        step_us = 1e3 * report["wall_ms_per_step"]
        total = sum(us for _, us in kernels)
        report.update({"kernels": len(kernels), "kernel_us": total, "gap_us": step_us - total,
                       "gap_share": (step_us - total) / step_us, "table": kernel_table(kernels, step_us)})
        print(f"\n{len(kernels)} kernels, {total:.0f} us of kernels in a {step_us:.0f} us step: outside kernels "
              f"{step_us - total:.0f} us ({100 * (step_us - total) / step_us:.1f}%)\n")
        print("| kernel | count | total us | share of step |\n| --- | --- | --- | --- |")
        for r in report["table"][:25]:
            print(f"| {r['kernel']} | {r['count']} | {r['total_us']:.1f} | {100 * r['share_of_step']:.1f}% |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
