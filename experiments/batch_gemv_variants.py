#!/usr/bin/env python3
"""Which tiling lets the fp16 decode GEMV of 8 tokens (schedules/cpu/gemv.py's tiled m-row kernel, a batched decode
step of issue 19) read as close to DRAM as the one-token GEMV does, on every core, beside helmc's stream read.

  python experiments/batch_gemv_variants.py --build-only DIR --hardware hw.json    # here, with the compiler
  python experiments/batch_gemv_variants.py --run-only DIR                         # there: tvm.runtime only

Why: on the GPU machine's Xeon the profile's fp16 GEMV read 89-109 GB/s at one token and 56-66 at 8 (sessions 13-18),
and the CPU stage's 8-row rate decided issue 19's bar (8 concurrent requests against llama-batched-bench). At m = 8
the kernel keeps 1 row x 8 tokens x 2 vectors of accumulators and walks K in tiles of X_TILE_BYTES of x (16 KiB:
512 elements, 1 KiB of each fp16 row) over blocks of TILE_BLOCK_ROWS rows: each thread advances 8 rows 1 KiB at a
time. Neither its FMAs (~20% of two ports at 5.6 GB/s a core) nor its L1 loads are near a limit, so the variants
change how the rows are walked: rows per block (streams per thread), x tile size (segment length; 1 MiB: no K
tiling, x from L2) and the prefetch level. Each variant is built by setting gemv.py's module constants; the m = 1
kernel is the baseline. Timed over weight copies of >= 4x L3 (12288 x 4096), best of --rounds, beside the read.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from bench_cpu_gemv import built_only, experiment_parser, target_features  # noqa: E402
from variants_lib import export_variants, load_variants  # noqa: E402

N, K, M = 12288, 4096, 8
# (TILE_BLOCK_ROWS, X_TILE_BYTES, TILE_PREFETCH_LOCALITY, BATCH_ROWS); the first is the committed setting.
# BATCH_ROWS 2 / 4: 2 or 4 weight rows in registers over 4 or 2 tokens a pass (2 or 4 passes over the rows' tile
# from L1): 0.75 loads an FMA instead of 1.125 and two or four weight streams in the inner loop instead of one. On
# the 2-core EPYC (session 20, one thread, Qwen3-8B's four shapes, bench_cpu_gemv --m 1,8) BATCH_ROWS 2 took
# 1.53-1.72x the one-row time where the default took 1.65-1.91x (16.1-17.7 GB/s against 14.0-15.4); not yet
# measured on the GPU machine's Xeon, where the kernel is not FMA-bound.
VARIANTS = [(8, 16384, 2, 0), (8, 16384, 3, 0), (4, 16384, 2, 0), (16, 16384, 2, 0), (8, 32768, 2, 0),
            (4, 32768, 2, 0), (8, 16384, 1, 0), (8, 16384, 2, 2), (8, 16384, 2, 4)]


def build(out_dir: str, features: tuple[str, ...], l3: int) -> None:
    from helmc.schedules.cpu import gemv
    from helmc.schedules.cpu.isa import select_isa

    isa = select_isa(features)
    funcs, kernels = {"v_m1": gemv.make_gemv(1, N, K, "float16", isa)}, [{"name": "v_m1", "m": 1}]
    saved = (gemv.TILE_BLOCK_ROWS, gemv.X_TILE_BYTES, gemv.TILE_PREFETCH_LOCALITY, gemv.BATCH_ROWS)
    try:
        for rows, tile, locality, batch_rows in VARIANTS:
            gemv.TILE_BLOCK_ROWS, gemv.X_TILE_BYTES, gemv.TILE_PREFETCH_LOCALITY, gemv.BATCH_ROWS = \
                rows, tile, locality, batch_rows
            name = f"v_m{M}_r{rows}_x{tile}_l{locality}" + (f"_g{batch_rows}" if batch_rows else "")
            funcs[name] = gemv.make_gemv(M, N, K, "float16", isa)
            kernels.append({"name": name, "m": M, "block_rows": rows, "x_tile_bytes": tile, "locality": locality,
                            "batch_rows": batch_rows})
    finally:
        gemv.TILE_BLOCK_ROWS, gemv.X_TILE_BYTES, gemv.TILE_PREFETCH_LOCALITY, gemv.BATCH_ROWS = saved
    export_variants(out_dir, funcs, kernels, features, l3, isa)


def run(out_dir: str, rounds: int) -> None:
    import tvm   # runtime only there

    meta, lib, read_gbs = load_variants(out_dir)
    rng = np.random.default_rng(0)
    copies = -(-4 * meta["l3"] // (N * K * 2))
    ws = [tvm.runtime.tensor((0.02 * rng.standard_normal((N, K))).astype(np.float16)) for _ in range(copies)]
    x8 = rng.standard_normal((M, K)).astype(np.float32)
    xs = {1: tvm.runtime.tensor(x8[:1]), M: tvm.runtime.tensor(x8)}          # token 0 the same in both
    ys = {m: tvm.runtime.tensor(np.zeros((m, N), np.float32)) for m in (1, M)}
    results, rows_m1 = [], None
    for k in meta["kernels"]:
        f, m = lib[k["name"]], k["m"]
        best, best_read = 0.0, 0.0
        for _ in range(rounds):
            best_read = max(best_read, read_gbs())
            t = time.perf_counter()
            for w in ws:
                f(xs[m], w, ys[m])
            best = max(best, copies * N * K * 2 / (time.perf_counter() - t) / 1e9)
        f(xs[m], ws[0], ys[m])
        first = ys[m].numpy()[0].copy()      # token 0's row: every variant sums it the m = 1 kernel's way
        rows_m1 = first if m == 1 else rows_m1
        same = bool(np.array_equal(first.view(np.uint32), rows_m1.view(np.uint32)))
        results.append({**k, "gbs": round(best, 2), "read_gbs": round(best_read, 2), "ratio": round(best / best_read, 3),
                        "row0_equals_m1": same})
        print(f"{k['name']:28s} {best:7.2f} GB/s  read {best_read:7.2f}  ratio {best / best_read:.3f}  "
              f"row 0 = m1's: {same}", flush=True)
    with open(os.path.join(os.environ.get("OUT", out_dir), "batch_gemv_variants.json"), "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    ap = experiment_parser(__doc__, rounds=5)
    a = ap.parse_args()
    if built_only(a, lambda d, features: build(d, features, target_features(a)[1])):
        return
    run(a.run_only, a.rounds)


if __name__ == "__main__":
    main()
