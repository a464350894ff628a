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
The "gemm" rows add the GEMM's other per-step work to the default loop, at its rate for a 128-token, K = 4096
GEMM with K blocks of 256 (one panel block packed per 32 steps, one C block stored into y per 128 steps):
  pack      copy 32 weight rows x 256 k (16 KiB, row stride 8 KiB) from the task's 2 MiB of weights into the
            A region, as the default blocking's panel packing does; pack = 1: the same copy spread over the
            block's 32 steps (8 rows' 64 bytes per step) into the A region's other half, while the products
            read this half (double buffering)
  y         store the 4 C tiles to the stack and write them transposed into y [128 tokens, 4096], as the
            kernel's end of K does

  python experiments/profile_amx_tiles.py --build-only DIR --hardware hw.json
  python experiments/profile_amx_tiles.py --run-only DIR [--rounds 5]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_cpu_gemv import built_only, experiment_parser, timed_rounds  # noqa: E402

KIB = 1024
TASKS = 16
STEPS = 1 << 14          # steps per task per call
# (mode, A region, B region, C every n steps[, pack every n steps, y every n steps]): regions in KiB per core.
CONFIGS = (
    ("regs", 4, 4, 0),
    ("2x2", 4, 4, 0), ("2x2", 16, 64, 0), ("2x2", 16, 64, 8), ("2x2", 16, 128, 8), ("2x2", 256, 256, 0),
    ("4x1", 4, 4, 0), ("4x1", 32, 64, 0), ("4x1", 32, 64, 8), ("4x1", 32, 64, 16),
    ("split2x2", 4, 8, 0), ("split2x2", 16, 128, 8),
    ("split4x1", 4, 8, 0), ("split4x1", 32, 128, 0), ("split4x1", 32, 128, 8), ("split4x1", 32, 128, 16),
    ("split4x1", 16, 64, 8),
    ("gemm", 16, 64, 8, 32, 0), ("gemm", 16, 64, 8, 0, 128), ("gemm", 16, 64, 8, 32, 128),
    ("gemm", 32, 64, 8, 1, 0), ("gemm", 32, 64, 8, 1, 128),
)
W_ROWS, W_K, Y_TOKENS = 256, 4096, 128     # per task: 8 panels of 32 rows of a K = 4096 weight; y's tokens
A_TILE, C_TILE = 16 * 32, 16 * 16   # gemm_amx's tile sizes in elements (not imported: run() has the TVM runtime only)
PRODUCTS = {"regs": 4, "2x2": 4, "gemm": 4, "4x1": 4, "split2x2": 8, "split4x1": 8}


def config_name(mode: str, a_kib: int, b_kib: int, c_every: int, pack_every: int = 0, y_every: int = 0) -> str:
    return f"amx_{mode}_a{a_kib}_b{b_kib}_c{c_every}_p{pack_every}_y{y_every}"


def make_loop(mode: str, a_kib: int, b_kib: int, c_every: int, pack_every: int = 0, y_every: int = 0):
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
             c: T.Buffer((TASKS * c_sets * 4 * C_TILE,), "float32"), w: T.Buffer((TASKS * W_ROWS * W_K,), "uint16"),
             y: T.Buffer((Y_TOKENS, TASKS * W_ROWS), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for task in T.parallel(TASKS):
            cfg = T.alloc_buffer((64,), "uint8", scope="global", annotations=STACK)
            ta = T.alloc_buffer((1,), "uint16", scope="global", annotations=STACK)
            tc = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
            cst = T.alloc_buffer((4 * C_TILE,), "float32", scope="global", annotations=STACK)
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
                if pack_every == 1:
                    ao = ab + ((s // 32) % 2 * 16 + (s % 8) * 2) * A_TILE   # this block's half, k step s % 8
                bo = bb + (s * 2 % b_tiles) * A_TILE           # this step's B tiles: 2 consecutive (4x1: 1)
                if mode == "regs":
                    dot(ta, tc, 0, 4, 6)
                    dot(ta, tc, 2, 5, 6)
                    dot(ta, tc, 1, 4, 7)
                    dot(ta, tc, 3, 5, 7)
                elif mode == "2x2" or mode == "split2x2" or mode == "gemm":
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
                if pack_every == 1:
                    # Interleaved: this step's share of the next panel block (8 of its 32 rows at this k step)
                    # into the other half of the A region, while the products read this half.
                    for r in T.unroll(8):
                        for cc in T.vectorized(32):
                            a[ab + ((s // 32 + 1) % 2) * 16 * A_TILE + ((s % 8) * 2 + (s % 32 // 8 * 8 + r) // 16)
                              * A_TILE + (s % 32 // 8 * 8 + r) % 16 * 32 + cc] = w[
                                task * W_ROWS * W_K + ((s // 128) % 8 * 32 + s % 32 // 8 * 8 + r) * W_K
                                + (s // 32) % 16 * 256 + s % 8 * 32 + cc]
                elif pack_every > 0:
                    if s % pack_every == 0:
                        for ah in T.serial(2):
                            for i in T.serial(TILE_ROWS):
                                for kb in T.serial(8):
                                    for cc in T.vectorized(32):
                                        a[ab + (kb * 2 + ah) * A_TILE + i * 32 + cc] = w[
                                            task * W_ROWS * W_K + ((s // 128) % 8 * 32 + ah * 16 + i) * W_K
                                            + (s // 32) % 16 * 256 + kb * 32 + cc]
                if y_every > 0:
                    if s % y_every == y_every - 1:
                        for r in T.unroll(4):
                            store_c(tc, r, cst, r * C_TILE)
                        for hb in T.serial(2):
                            for j in T.serial(16):
                                for ah in T.serial(2):
                                    for i in T.vectorized(TILE_ROWS):
                                        y[(s // y_every) % 4 * 32 + hb * 16 + j,
                                          task * W_ROWS + (s // 512) % 8 * 32 + ah * 16 + i] = \
                                            cst[(ah * 2 + hb) * C_TILE + i * 16 + j]
            for r in T.unroll(4):
                store_c(tc, r, c, cb + r * C_TILE)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return loop.with_attr("global_symbol", config_name(mode, a_kib, b_kib, c_every, pack_every, y_every))


def build(out_dir, features):
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
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
    # bf16 bits of values in [1, 2): finite products, no denormals.
    w = tensor_from_numpy(rng.integers(0x3F80, 0x4000, TASKS * W_ROWS * W_K, dtype=np.uint16), "uint16", dev)
    y = tensor_from_numpy(np.zeros((Y_TOKENS, TASKS * W_ROWS), np.float32), "float32", dev)
    for cfg in CONFIGS:
        mode, a_kib, b_kib = cfg[:3]
        a_tiles, b_tiles = a_kib * KIB // (2 * A_TILE), b_kib * KIB // (2 * A_TILE)
        a = tensor_from_numpy(rng.integers(0x3F80, 0x4000, TASKS * a_tiles * A_TILE, dtype=np.uint16), "uint16", dev)
        b = tensor_from_numpy(rng.integers(0x3F80, 0x4000, TASKS * b_tiles * A_TILE, dtype=np.uint16), "uint16", dev)
        c = tensor_from_numpy(np.zeros(TASKS * 32 * 4 * C_TILE, np.float32), "float32", dev)
        fn = lib[config_name(*cfg)]
        fn(a, b, c, w, y)
        passes[cfg] = (lambda fn=fn, a=a, b=b, c=c: fn(a, b, c, w, y))
    times = timed_rounds(passes, rounds)
    for cfg, ts in times.items():
        mode, a_kib, b_kib, c_every, pack_every, y_every = (cfg + (0, 0))[:6]
        products = TASKS * STEPS * PRODUCTS[mode]
        best = min(ts)
        rows.append({"mode": mode, "a_kib": a_kib, "b_kib": b_kib, "c_every": c_every, "pack_every": pack_every,
                     "y_every": y_every, "ms": round(best * 1e3, 3),
                     "tflops": round(products * 16 * 16 * 32 * 2 / best / 1e12, 2),
                     "cycles_per_product_at_2ghz": round(best * 2e9 / (STEPS * PRODUCTS[mode]), 1)})
    return {"tasks": TASKS, "steps": STEPS, "rounds": rounds, "rows": rows}


def main():
    ap = experiment_parser(__doc__, rounds=5)
    a = ap.parse_args()
    if built_only(a, build):
        return
    rep = run(a.run_only, a.rounds)
    print(json.dumps(rep))
    print(f"{'mode':>9} {'A KiB':>6} {'B KiB':>6} {'C every':>7} {'pack':>5} {'y':>4} {'ms':>7} {'TFLOPS':>7} "
          f"{'cyc/prod@2GHz':>13}")
    for r in rep["rows"]:
        print(f"{r['mode']:>9} {r['a_kib']:>6} {r['b_kib']:>6} {r['c_every']:>7} {r['pack_every']:>5} {r['y_every']:>4} "
              f"{r['ms']:>7} {r['tflops']:>7} "
              f"{r['cycles_per_product_at_2ghz']:>13}")


if __name__ == "__main__":
    main()
