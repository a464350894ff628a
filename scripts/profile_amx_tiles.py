#!/usr/bin/env python3
"""What limits the AMX GEMM's tile products? Synthetic loops of the prefill GEMM's inner step (gemm_amx.py) on
every core, each core cycling its own A, B and C regions sized to sit in L1 or L2, so the product rate can be
read against where the tiles come from and how many loads each product needs:

  regs      4 products per step on tiles loaded once: the product rate itself
  2x2       today's default step: 2 A + 2 B loads, 4 products (C 2 x 2)
  split2x2  today's split step: 2 A + 4 B (hi, lo) loads, 8 products
  4x1       4 A + 1 B loads, 4 products (C 4 x 1: one B tile shared by four A tiles)
  split4x1  4 A + 2 B (hi, lo) loads, 8 products: each A tile meets the hi and the lo B tile
C tiles are loaded and stored every `c_every` steps (as the GEMM does between K blocks) or never (0).

  python scripts/profile_amx_tiles.py --build-only DIR --hardware hw.json
  python scripts/profile_amx_tiles.py --run-only DIR [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_gemv import target_features, timed_rounds  # noqa: E402

KIB = 1024
TASKS = 16
STEPS = 1 << 14          # steps per task per call
# (mode, A region, B region, C every n steps): regions in KiB per core.
CONFIGS = (
    ("regs", 4, 4, 0),
    ("2x2", 4, 4, 0), ("2x2", 16, 64, 0), ("2x2", 16, 64, 8), ("2x2", 16, 128, 8), ("2x2", 256, 256, 0),
    ("4x1", 4, 4, 0), ("4x1", 32, 64, 0), ("4x1", 32, 64, 8), ("4x1", 32, 64, 16),
    ("split2x2", 4, 8, 0), ("split2x2", 16, 128, 8),
    ("split4x1", 4, 8, 0), ("split4x1", 32, 128, 0), ("split4x1", 32, 128, 8), ("split4x1", 32, 128, 16),
    ("split4x1", 16, 64, 8),
)
A_TILE, C_TILE = 16 * 32, 16 * 16   # gemm_amx's tile sizes in elements (not imported: run() has the TVM runtime only)
PRODUCTS = {"regs": 4, "2x2": 4, "4x1": 4, "split2x2": 8, "split4x1": 8}


def make_loop(mode: str, a_kib: int, b_kib: int, c_every: int):
    from tvm.script import tirx as T
    from helmc.schedules.cpu.gemm_amx import TILE_ROWS, _tile_ops
    from helmc.schedules.cpu.weight_load import STACK
    load16, load_c, store_c, _zero_c, dot = _tile_ops(False)
    a_tiles, b_tiles = a_kib * KIB // (2 * A_TILE), b_kib * KIB // (2 * A_TILE)
    c_sets = 32                                       # C regions cycled: 32 x 4 KiB = 128 KiB per core (L2)
    assert a_tiles & (a_tiles - 1) == 0 and b_tiles & (b_tiles - 1) == 0, (a_kib, b_kib)
    split = mode.startswith("split")

    @T.prim_func
    def loop(a: T.Buffer((TASKS * a_tiles * A_TILE,), "uint16"), b: T.Buffer((TASKS * b_tiles * A_TILE,), "uint16"),
             c: T.Buffer((TASKS * c_sets * 4 * C_TILE,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for task in T.parallel(TASKS):
            cfg = T.alloc_buffer((64,), "uint8", scope="global", annotations=STACK)
            ta = T.alloc_buffer((1,), "uint16", scope="global", annotations=STACK)
            tc = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
            for i in T.serial(64):
                cfg[i] = T.uint8(0)
            cfg[0] = T.uint8(1)
            for t in T.serial(8):
                cfg[16 + 2 * t] = T.uint8(64)
                cfg[48 + t] = T.uint8(TILE_ROWS)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            ab = task * a_tiles * A_TILE
            bb = task * b_tiles * A_TILE
            cb = task * c_sets * 4 * C_TILE
            for r in T.unroll(4):
                load_c(tc, r, c, cb + r * C_TILE)
            load16(ta, 4, a, ab, 32)
            load16(ta, 5, a, ab + A_TILE, 32)
            load16(ta, 6, b, bb, 32)
            load16(ta, 7, b, bb + A_TILE, 32)
            for s in T.serial(STEPS):
                ao = ab + (s * 4 % a_tiles) * A_TILE           # this step's A tiles: 4 consecutive (2x2: 2)
                bo = bb + (s * 2 % b_tiles) * A_TILE           # this step's B tiles: 2 consecutive (4x1: 1)
                if mode == "regs":
                    dot(ta, tc, 0, 4, 6)
                    dot(ta, tc, 2, 5, 6)
                    dot(ta, tc, 1, 4, 7)
                    dot(ta, tc, 3, 5, 7)
                elif mode == "2x2" or mode == "split2x2":
                    load16(ta, 4, a, ao, 32)
                    load16(ta, 5, a, ao + A_TILE, 32)
                    load16(ta, 6, b, bo, 32)
                    load16(ta, 7, b, bo + A_TILE, 32)
                    dot(ta, tc, 0, 4, 6)
                    dot(ta, tc, 2, 5, 6)
                    if split:
                        load16(ta, 6, b, bb + ((s * 2 + 1) * 2 % b_tiles) * A_TILE, 32)
                    dot(ta, tc, 1, 4, 7)
                    dot(ta, tc, 3, 5, 7)
                    if split:
                        load16(ta, 7, b, bb + ((s * 2 + 1) * 2 % b_tiles + 1) * A_TILE, 32)
                        dot(ta, tc, 0, 4, 6)
                        dot(ta, tc, 2, 5, 6)
                        dot(ta, tc, 1, 4, 7)
                        dot(ta, tc, 3, 5, 7)
                else:
                    # 4x1: B (hi in 6, lo in 7) shared by four A tiles rotating through 4, 5.
                    load16(ta, 6, b, bo, 32)
                    if split:
                        load16(ta, 7, b, bo + A_TILE, 32)
                    load16(ta, 4, a, ao, 32)
                    load16(ta, 5, a, ao + A_TILE, 32)
                    dot(ta, tc, 0, 4, 6)
                    if split:
                        dot(ta, tc, 0, 4, 7)
                    load16(ta, 4, a, ao + 2 * A_TILE, 32)
                    dot(ta, tc, 1, 5, 6)
                    if split:
                        dot(ta, tc, 1, 5, 7)
                    load16(ta, 5, a, ao + 3 * A_TILE, 32)
                    dot(ta, tc, 2, 4, 6)
                    if split:
                        dot(ta, tc, 2, 4, 7)
                    dot(ta, tc, 3, 5, 6)
                    if split:
                        dot(ta, tc, 3, 5, 7)
                if c_every > 0:
                    if s % c_every == c_every - 1:
                        for r in T.unroll(4):
                            store_c(tc, r, c, cb + ((s // c_every) % c_sets * 4 + r) * C_TILE)
                        for r in T.unroll(4):
                            load_c(tc, r, c, cb + (((s // c_every) + 1) % c_sets * 4 + r) * C_TILE)
            for r in T.unroll(4):
                store_c(tc, r, c, cb + r * C_TILE)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return loop.with_attr("global_symbol", f"amx_{mode}_a{a_kib}_b{b_kib}_c{c_every}")


def build(out_dir, features):
    import tvm
    from helmc.schedule_cpu_stage import llvm_target
    funcs = {str(f.attrs["global_symbol"]): f for f in (make_loop(*cfg) for cfg in CONFIGS)}
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, "tiles.so"))


def run(out_dir, rounds):
    import ctypes
    import numpy as np
    import tvm.runtime
    from helmc.runtime.tvm_tensors import tensor_from_numpy
    # The loops ask no AMX permission themselves (the GEMM does, per call): ask once for the process.
    assert ctypes.CDLL(None).syscall(158, 0x1023, 18) == 0, "arch_prctl(ARCH_REQ_XCOMP_PERM) refused"
    lib = tvm.runtime.load_module(os.path.join(out_dir, "tiles.so"))
    dev, rng = tvm.runtime.cpu(), np.random.default_rng(0)
    rows, passes = [], {}
    for mode, a_kib, b_kib, c_every in CONFIGS:
        a_tiles, b_tiles = a_kib * KIB // (2 * A_TILE), b_kib * KIB // (2 * A_TILE)
        # bf16 bits of values in [1, 2): finite products, no denormals.
        a = tensor_from_numpy(rng.integers(0x3F80, 0x4000, TASKS * a_tiles * A_TILE, dtype=np.uint16), "uint16", dev)
        b = tensor_from_numpy(rng.integers(0x3F80, 0x4000, TASKS * b_tiles * A_TILE, dtype=np.uint16), "uint16", dev)
        c = tensor_from_numpy(np.zeros(TASKS * 32 * 4 * C_TILE, np.float32), "float32", dev)
        fn = lib[f"amx_{mode}_a{a_kib}_b{b_kib}_c{c_every}"]
        fn(a, b, c)
        passes[(mode, a_kib, b_kib, c_every)] = (lambda fn=fn, a=a, b=b, c=c: fn(a, b, c))
    times = timed_rounds(passes, rounds)
    for (mode, a_kib, b_kib, c_every), ts in times.items():
        products = TASKS * STEPS * PRODUCTS[mode]
        best = min(ts)
        rows.append({"mode": mode, "a_kib": a_kib, "b_kib": b_kib, "c_every": c_every, "ms": round(best * 1e3, 3),
                     "tflops": round(products * 16 * 16 * 32 * 2 / best / 1e12, 2),
                     "cycles_per_product_at_2ghz": round(best * 2e9 / (STEPS * PRODUCTS[mode]), 1)})
    return {"tasks": TASKS, "steps": STEPS, "rounds": rounds, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-only")
    ap.add_argument("--run-only")
    ap.add_argument("--hardware", help="hardware.json whose CPU features to compile for (default: this CPU)")
    ap.add_argument("--features", help="comma list of /proc/cpuinfo flags to compile for (default: this CPU)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if a.build_only:
        build(a.build_only, target_features(a)[0])
        return
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    rep = run(a.run_only, a.rounds)
    print(json.dumps(rep))
    print(f"{'mode':>9} {'A KiB':>6} {'B KiB':>6} {'C every':>7} {'ms':>7} {'TFLOPS':>7} {'cyc/prod@2GHz':>13}")
    for r in rep["rows"]:
        print(f"{r['mode']:>9} {r['a_kib']:>6} {r['b_kib']:>6} {r['c_every']:>7} {r['ms']:>7} {r['tflops']:>7} "
              f"{r['cycles_per_product_at_2ghz']:>13}")


if __name__ == "__main__":
    main()
