#!/usr/bin/env python3
"""Hybrid decode against the plain split on the GPU machine (issue 17): decode ms/token of one bundle run three ways.

    python tests/device/device_hybrid_check.py BUNDLE [--weights DIR] [--new-tokens 64] [--requests 3]
        [--prompt-len 128] [--out FILE.json]

  hybrid        the bundle as built (its plan must have streamed groups: `helmc build` chose hybrid decode, or
                tests/device/build_hybrid_bundles.py forced a layout)
  plain same k  the same host blocks, all computed by the CPU (the plan's groups dropped): what the hybrid
                executor replaces
  plain best    the fastest feasible plain split of the plan's candidates (more blocks in VRAM: no ring), when the
                plan has candidates and it differs from the same k
Each: one warm-up request, then --requests greedy requests of --new-tokens on the same seeded prompt; p50 of the
per-token latencies. Prints a table (ms/token, tok/s, T_plan, speedup over each plain run, the host weights' read
rate per token and, for hybrid, the bytes through the ring per token and the profile's DRAM + PCIe rate), whether
the greedy tokens equal the plain same-k run's, and writes the rows to --out. Runtime-only: no compiler import.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def plain_plan(plan, k: int | None = None):
    """`plan` as the plain split cpu(k) -> cuda(rest) (default its own k), timed and sized by its candidate row."""
    k = plan.cpu_units if k is None else k
    row = plan.candidates[k] if plan.candidates else None
    times = (dict(t_cpu_ms=row.t_cpu_ms, t_gpu_ms=row.t_gpu_ms, t_comm_ms=row.t_comm_ms, t_plan_ms=row.t_plan_ms,
                  gpu_bytes=row.gpu_bytes, cpu_bytes=row.cpu_bytes, max_context=min(row.max_context, plan.max_context))
             if row is not None else dict(t_cpu_ms=0.0, t_plan_ms=plan.t_gpu_ms + plan.t_comm_ms))
    host_blocks = 0 < k - 1 and k < plan.num_units
    return dataclasses.replace(plan, cpu_units=k, groups=(), staging_ring_bytes=0, t_copy_ms=0.0, candidates=(),
                               hybrid_candidates=(), prefill_on_gpu=plan.prefill_on_gpu and host_blocks,
                               prefill_staging_bytes=plan.prefill_staging_bytes if host_blocks else 0,
                               gpu_kv_pool_bytes=plan.gpu_kv_pool_bytes if k == plan.cpu_units else 0, **times)


def run(bundle: str, weights: str | None, plan, prompt: list[int], new_tokens: int, requests: int) -> dict:
    import gc

    from helmc.runtime.session import Session
    t = time.perf_counter()
    s = Session.load(bundle, weights_dir=weights, plan=plan)
    load_s = time.perf_counter() - t
    s.generate(prompt_ids=prompt, max_new_tokens=4, stop_at_eos=False)                  # warm-up
    per, tokens = [], None
    for _ in range(requests):
        r = s.generate(prompt_ids=prompt, max_new_tokens=new_tokens, stop_at_eos=False)
        per.append(statistics.median(r.per_token_ms))
        tokens = tokens or list(r.tokens)
    p = s.plan
    ms = statistics.median(per)
    out = {"plan": p.describe(), "cpu_units": p.cpu_units, "hybrid": p.is_hybrid, "ms_per_token_p50": ms,
           "tok_s": 1e3 / ms, "t_plan_ms": p.t_plan_ms, "load_s": load_s, "tokens": tokens,
           "host_weight_gbs": p.cpu_weight_bytes / (ms * 1e-3) / 1e9}
    if p.is_hybrid:
        h = s.gpu.hybrid
        steps = max(1, h.tokens)
        out.update(schedule=h.schedule.describe(), ring_bytes=h.schedule.ring_bytes,
                   streamed_bytes_per_token=h.backend.bytes_copied / steps,
                   pcie_gbs=h.backend.bytes_copied / steps / (ms * 1e-3) / 1e9)
    graph = getattr(s.gpu, "decode_graph", None)
    out["graph_replays"] = graph.replays if graph is not None else 0
    del s
    gc.collect()
    try:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except ImportError:
        pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--weights", default=None, help="weights directory (default: the bundle's)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from helmc.runtime.session import read_bundle
    _, spec, plan, _ = read_bundle(a.bundle, a.weights)
    if not plan.is_hybrid:
        print(f"{a.bundle}: plan {plan.describe()} has no streamed groups (build with a profile whose DRAM + PCIe "
              "window makes hybrid win, or force a layout: tests/device/build_hybrid_bundles.py)")
        return 2
    prompt = np.random.default_rng(0).integers(3, spec.vocab_size, a.prompt_len).tolist()
    runs = {"hybrid": plan, "plain same k": plain_plan(plan)}
    feasible = [c for c in plan.candidates if c.feasible]
    if feasible:
        best = min(feasible, key=lambda c: (c.t_plan_ms, c.cpu_units)).cpu_units
        if best != plan.cpu_units:
            runs["plain best"] = plain_plan(plan, best)
    rows = {}
    for name, p in runs.items():
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {p.describe()}", flush=True)
        rows[name] = run(a.bundle, a.weights, p, prompt, a.new_tokens, a.requests)
    h = rows["hybrid"]
    print("\n| run | plan | ms/token p50 | tok/s | T_plan ms | hybrid speedup | host weights GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['plan']} | {r['ms_per_token_p50']:.2f} | {r['tok_s']:.2f} | {r['t_plan_ms']:.2f} | "
              f"{r['ms_per_token_p50'] / h['ms_per_token_p50']:.3f}x | {r['host_weight_gbs']:.1f} |")
    hw_path = os.path.join(a.bundle, "hardware.json")
    combined = None
    if os.path.isfile(hw_path):
        with open(hw_path) as f:
            link = json.load(f).get("link") or {}
        if link.get("h2d_concurrent_gbs"):
            combined = link["h2d_concurrent_gbs"] + link.get("cpu_read_concurrent_gbs", 0.0)
    share = f", {h['host_weight_gbs'] / combined:.0%} of the profile's DRAM + PCIe {combined:.1f} GB/s" if combined else ""
    print(f"\nhybrid: {h['schedule']}; {h['streamed_bytes_per_token'] / 2**20:.1f} MiB/token through the ring "
          f"({h['pcie_gbs']:.1f} GB/s over PCIe); host weights read at {h['host_weight_gbs']:.1f} GB/s{share}")
    same = h["tokens"] == rows["plain same k"]["tokens"]
    print(f"greedy tokens equal to the plain same-k run: {same}")
    report = {"bundle": a.bundle, "runs": rows, "tokens_equal_plain_same_k": same, "profile_dram_pcie_gbs": combined}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
