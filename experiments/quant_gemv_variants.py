#!/usr/bin/env python3
"""Which row count, prefetch distance and prefetch level let the int8 Q4_K / Q6_K / Q4_0 decode GEMVs
(schedules/cpu/quant/gemv_int8.py, quant/q4_0_int8.py) read closest to DRAM on every core (issue 15's >= 80% bar),
beside helmc's stream read in the same run.

  python experiments/quant_gemv_variants.py --build-only DIR --hardware hw.json    # here, with the compiler
  python experiments/quant_gemv_variants.py --run-only DIR                         # there: tvm.runtime only
Each variant is timed over weight copies of >= 4x L3 (12288 x 4096, the gate/up shape), best of --rounds passes,
interleaved with the stream read; prints GB/s of quantized bytes and the ratio to the read, and each type's fp32-lane
kernel (gemv_quant.make_gemv_quant_float) as the baseline. Session 11 (call F): an int8 Q4_0 kernel of two blocks per
vpdpbusd read 50-62 GB/s against the fp32-lane kernel's 53-60 and was dropped; session 18's (four blocks a step,
q - 8 folded into the chain's start) read 70-77 GB/s in `helmc profile` on three hosts where the fp32-lane kernel
had read 55 on a fourth: this run puts both beside one stream read. Variants: (rows, prefetch bytes, locality:
3 = prefetcht0 into L1, 2 = prefetcht1 into L2).
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

N, K = 12288, 4096
QTYPES = ("q4_k", "q6_k", "q4_0")
# (rows, prefetch bytes, locality); each type's first is its committed INT8_TUNING
VARIANTS = {"q4_k": [(8, 1024, 3), (8, 1024, 2), (8, 4096, 2), (8, 8192, 2), (4, 4096, 2), (16, 2048, 2),
                     (16, 4096, 2)],
            "q6_k": [(4, 1024, 3), (4, 2048, 2), (8, 2048, 2)],
            "q4_0": [(8, 2048, 2), (8, 1024, 3), (8, 4096, 2), (4, 2048, 2), (16, 2048, 2)]}


def build(out_dir: str, features: tuple[str, ...], l3: int) -> None:
    from helmc.schedules.cpu.gemv_quant import QuantGemvTuning, make_gemv_quant_float, quant_row_bytes
    from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant
    from helmc.schedules.cpu.isa import select_isa

    isa = select_isa(features)
    funcs, kernels = {}, []
    for qtype in QTYPES:
        for rows, prefetch, locality in VARIANTS[qtype]:
            name = f"v_{qtype}_r{rows}_p{prefetch}_l{locality}"
            tuning = QuantGemvTuning(rows=rows, prefetch_bytes=prefetch, prefetch_locality=locality)
            funcs[name] = make_gemv_quant(qtype, N, K, isa, tuning)
            kernels.append({"name": name, "qtype": qtype, "rows": rows, "prefetch": prefetch, "locality": locality,
                            "row_bytes": quant_row_bytes(qtype, K)})
        # The fp32-lane kernel at its default tuning, the baseline the integer one must beat.
        name = f"v_{qtype}_float"
        funcs[name] = make_gemv_quant_float(qtype, N, K, isa)
        kernels.append({"name": name, "qtype": qtype, "rows": 4, "prefetch": 2048, "float": True,
                        "row_bytes": quant_row_bytes(qtype, K)})
    export_variants(out_dir, funcs, kernels, features, l3, isa)


def run(out_dir: str, rounds: int) -> None:
    import tvm   # runtime only there: no helmc.schedules import (it needs the TVM compiler)

    meta, lib, read_gbs = load_variants(out_dir)
    rng = np.random.default_rng(0)
    x = tvm.runtime.tensor(rng.standard_normal((1, K)).astype(np.float32))
    y = tvm.runtime.tensor(np.zeros((1, N), np.float32))
    results = []
    for qtype in QTYPES:
        row = next(k["row_bytes"] for k in meta["kernels"] if k["qtype"] == qtype)
        copies = -(-4 * meta["l3"] // (N * row))
        ws = [tvm.runtime.tensor(rng.integers(0, 256, (N, row), dtype=np.uint8)) for _ in range(copies)]
        for w in ws:                                   # fp16 fields: finite scales (random bytes may be NaN / inf)
            a = w.numpy()
            fields = {"q4_k": (0, 2), "q6_k": (208,), "q4_0": (0,)}[qtype]
            blocks = a.reshape(N, -1, {"q4_k": 144, "q6_k": 210, "q4_0": 18}[qtype])
            for at in fields:
                blocks[:, :, at:at + 2] = np.array([1e-3], np.float16).view(np.uint8)[None, None, :]
            w.copyfrom(a)
        for k in meta["kernels"]:
            if k["qtype"] != qtype:
                continue
            f = lib[k["name"]]
            best, best_read = 0.0, 0.0
            for _ in range(rounds):
                best_read = max(best_read, read_gbs())
                t = time.perf_counter()
                for w in ws:
                    f(x, w, y)
                best = max(best, copies * N * row / (time.perf_counter() - t) / 1e9)
            results.append({**k, "gbs": round(best, 2), "read_gbs": round(best_read, 2),
                            "ratio": round(best / best_read, 3)})
            print(f"{k['name']:24s} {best:7.2f} GB/s  read {best_read:7.2f}  ratio {best / best_read:.3f}", flush=True)
    with open(os.path.join(os.environ.get("OUT", out_dir), "quant_gemv_variants.json"), "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    ap = experiment_parser(__doc__, rounds=5)
    a = ap.parse_args()
    if built_only(a, lambda d, features: build(d, features, target_features(a)[1])):
        return
    run(a.run_only, a.rounds)


if __name__ == "__main__":
    main()
