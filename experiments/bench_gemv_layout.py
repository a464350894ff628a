#!/usr/bin/env python3
"""Which weight layout and loop shape lets a decode GEMV read at the DRAM ceiling? An experiment beside
bench_cpu_gemv.py: one token, bf16 weights, Qwen3-8B projection shapes, every variant reading its own
weight copies (>= 4x L3 per pass) and the stream read over those same pages, interleaved rounds.

Variants (rows per step x k per row per step, accumulator lanes):
  hf_r4_pf16   gemv.make_gemv as built today: HF layout [N, K], 4 rows, software prefetch 16 steps ahead
  hf_r4        same loop, no software prefetch
  hf_r1        one row per step, 64 k: each thread reads one sequential stream in HF layout
  tile_r4      weights repacked [N/4][K/32][4][32]: each step reads 256 contiguous bytes, one stream per thread
  tile_r8      [N/8][K/32][8][32], 16-lane accumulators
  tile_r16     [N/16][K/32][16][32] (the AMX A-tile layout), 16-lane accumulators

  python experiments/bench_gemv_layout.py --build-only DIR --hardware hw.json
  python experiments/bench_gemv_layout.py --run-only DIR [--rounds 7]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_cpu_gemv import built_only, experiment_parser, l3_bytes, timed_rounds  # noqa: E402

SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))
VARIANTS = {  # name: (layout, rows, width (k per row per step), lanes, software prefetch steps)
    "hf_r4_pf16": ("hf", 4, 32, 32, 16),
    "hf_r4": ("hf", 4, 32, 32, 0),
    "hf_r1": ("hf", 1, 64, 64, 0),
    "tile_r4": ("tile", 4, 32, 32, 0),
    "tile_r8": ("tile", 8, 32, 16, 0),
    "tile_r16": ("tile", 16, 32, 16, 0),
}


def make_variant(n, k, layout, rows, width, lanes, pf):
    from tvm.script import tirx as T
    from helmc.schedules.cpu.weight_load import STACK, widen
    steps_k = k // width
    halves = width // lanes
    assert n % rows == 0 and k % width == 0 and width % lanes == 0

    def idx(step, r, ko, h, v):
        if layout == "hf":
            return (step * rows + r) * k + ko * width + h * lanes + v
        return (step * steps_k + ko) * rows * width + r * width + h * lanes + v

    @T.prim_func
    def gemv(x: T.Buffer((1, k), "float32"), w: T.Buffer((n * k,), "uint16"), y: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for step in T.parallel(n // rows):
            acc = T.alloc_buffer((rows, lanes), "float32", scope="global", annotations=STACK)
            for r in T.unroll(rows):
                for v in T.vectorized(lanes):
                    acc[r, v] = T.float32(0)
            for ko in T.serial(steps_k):
                if pf > 0:
                    for r in T.unroll(rows):
                        T.evaluate(T.call_llvm_intrin(
                            "void", "llvm.prefetch", T.address_of(w[T.min(
                                T.if_then_else(ko + pf < steps_k, (step * rows + r) * k + (ko + pf) * width,
                                               (step * rows + rows + r) * k + (ko + pf - steps_k) * width),
                                n * k - 1)]), T.int32(0), T.int32(3), T.int32(1)))
                for h in T.unroll(halves):
                    for r in T.unroll(rows):
                        for v in T.vectorized(lanes):
                            acc[r, v] = acc[r, v] + x[0, ko * width + h * lanes + v] * widen(
                                w[idx(step, r, ko, h, v)], "bfloat16")
            for r in T.unroll(rows):
                total = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
                total[0] = T.float32(0)
                for v in T.unroll(lanes):
                    total[0] = total[0] + acc[r, v]
                y[0, step * rows + r] = total[0]

    return gemv


def repack(w16, layout, rows, width):
    """HF [n, k] uint16 -> the variant's layout, flat."""
    n, k = w16.shape
    if layout == "hf":
        return w16.reshape(-1)
    return w16.reshape(n // rows, rows, k // width, width).transpose(0, 2, 1, 3).reshape(-1)  # [N/r][K/w][r][w]


def build(out_dir, features):
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements
    isa = select_isa(features)
    funcs = {}
    for n, k in SHAPES:
        for name, v in VARIANTS.items():
            funcs[f"{name}_{n}_{k}"] = make_variant(n, k, *v).with_attr("global_symbol", f"{name}_{n}_{k}")
        e = n * k // 2
        assert e == stream_read_elements(n * k * 2, isa)
        funcs[f"read_{e}"] = make_stream_read(e, isa).with_attr("global_symbol", f"read_{e}")
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}),
                      target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, "layout.so"))


def run(out_dir, rounds):
    import numpy as np
    import tvm.runtime
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, float32_from_bf16_bits, tensor_from_numpy
    lib = tvm.runtime.load_module(os.path.join(out_dir, "layout.so"))
    dev = tvm.runtime.cpu()
    rng = np.random.default_rng(0)
    min_bytes = 4 * l3_bytes()
    partial = tvm.runtime.empty((1024,), "float32", dev)
    rows_out = []
    for n, k in SHAPES:
        w16 = bf16_bits_from_float32(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
        x32 = rng.standard_normal((1, k), dtype=np.float32)
        ref = x32.astype(np.float64) @ float32_from_bf16_bits(w16).astype(np.float64).T
        x, y = tensor_from_numpy(x32, "float32", dev), tvm.runtime.empty((1, n), "float32", dev)
        copies = max(1, -(-min_bytes // (n * k * 2)))
        passes, sets, err = {}, {}, {}
        read = lib[f"read_{n * k // 2}"]
        for name, (layout, r, width, _, _) in VARIANTS.items():
            packed = repack(w16, layout, r, width)
            sets[name] = [tensor_from_numpy(packed, "uint16", dev) for _ in range(copies)]
            fn = lib[f"{name}_{n}_{k}"]
            fn(x, sets[name][0], y)
            err[name] = float(np.abs(y.numpy() - ref).max() / np.abs(ref).max())
            passes[name] = (lambda fn=fn, ws=sets[name]: [fn(x, w, y) for w in ws])
            views = [w._create_view((n * k // 2,), "float32") for w in sets[name]]
            passes[f"pages_{name}"] = (lambda vs=views: [read(v, partial) for v in vs])
        times = timed_rounds(passes, rounds)
        nbytes = n * k * 2 * copies
        for name in VARIANTS:
            gbs = [nbytes / t / 1e9 for t in times[name]]
            pg = [nbytes / t / 1e9 for t in times[f"pages_{name}"]]
            rows_out.append({"shape": [n, k], "variant": name, "gbs": round(max(gbs), 1),
                             "gbs_median": round(float(np.median(gbs)), 1), "pages_gbs": round(max(pg), 1),
                             "over_pages": round(max(gbs) / max(pg), 3), "rel_err": err[name]})
        del sets
    return {"rounds": rounds, "l3_bytes": l3_bytes(), "results": rows_out}


def main():
    ap = experiment_parser(__doc__, rounds=7)
    ap.add_argument("--out")
    a = ap.parse_args()
    if built_only(a, build):
        return
    rep = run(a.run_only, a.rounds)
    if a.out:
        json.dump(rep, open(a.out, "w"), indent=1)
    print(f"{'shape':>12} {'variant':>11} {'GB/s':>7} {'median':>7} {'pages':>7} {'/pages':>7} {'err':>8}")
    for r in rep["results"]:
        print(f"{'x'.join(map(str, r['shape'])):>12} {r['variant']:>11} {r['gbs']:>7} {r['gbs_median']:>7} "
              f"{r['pages_gbs']:>7} {r['over_pages']:>7} {r['rel_err']:8.1e}")


if __name__ == "__main__":
    main()
