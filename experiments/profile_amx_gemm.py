#!/usr/bin/env python3
"""Where does the AMX prefill GEMM's time go? Each blocking variant, at the model's precision and split, for
two Qwen3-8B shapes, timed with the weights cycled from DRAM ("cold", >= 4x L3 of copies in one arena) and
with one copy re-read from L3 ("hot"), beside torch's bf16 linear the same two ways. A kernel whose hot and
cold times agree is bound by its own instruction stream, not by DRAM.

  python experiments/profile_amx_gemm.py --build-only DIR --hardware hw.json
  python experiments/profile_amx_gemm.py --run-only DIR [--rounds 7] [--tokens 128]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_cpu_gemv import (WeightArena, arena_bytes, built_only, copy_count, experiment_parser, l3_bytes,  # noqa: E402
                            timed_rounds, weight_copies)

SHAPES = ((4096, 4096), (12288, 4096))


def build(out_dir, features):
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
    from helmc.schedules.cpu.gemm_amx import BLOCKING_VARIANTS, make_gemm_amx
    kernels, funcs = [], {}
    for n, k in SHAPES:
        for split in (False, True):
            for blk in BLOCKING_VARIANTS:
                f = make_gemm_amx(n, k, "bfloat16", blocking=blk, split_activations=split)
                name = str(f.attrs["global_symbol"])
                funcs[name] = f
                kernels.append({"shape": [n, k], "split": split, "blocking": blk.name or "default", "name": name})
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, "amx.so"))
    json.dump({"kernels": kernels}, open(os.path.join(out_dir, "amx.json"), "w"), indent=1)


def run(out_dir, rounds, tokens):
    import numpy as np
    import torch
    import tvm.runtime
    from helmc.runtime.tvm_tensors import tensor_from_numpy
    lib = tvm.runtime.load_module(os.path.join(out_dir, "amx.so"))
    kernels = json.load(open(os.path.join(out_dir, "amx.json")))["kernels"]
    dev = tvm.runtime.cpu()
    min_bytes = 4 * l3_bytes()
    arena = WeightArena(arena_bytes(0, [copy_count(n, k, min_bytes) * n * k * 2 for n, k in SHAPES]))
    rng = np.random.default_rng(0)
    rows = []
    for n, k in SHAPES:
        weights, w64 = weight_copies(rng, n, k, "bfloat16", min_bytes, arena)
        x32 = rng.standard_normal((tokens, k), dtype=np.float32)
        x, y = tensor_from_numpy(x32, "float32", dev), tvm.runtime.empty((tokens, n), "float32", dev)
        ref = x32.astype(np.float64) @ w64.T
        tw = [torch.from_dlpack(w) for w in weights]
        xt = torch.from_numpy(x32).to(torch.bfloat16)
        hot_reps = len(weights)
        passes = {"torch cold": lambda: [torch.nn.functional.linear(xt, w) for w in tw],
                  "torch hot": lambda: [torch.nn.functional.linear(xt, tw[0]) for _ in range(hot_reps)]}
        errs = {}
        for kern in (kk for kk in kernels if kk["shape"] == [n, k]):
            fn = lib[kern["name"]]
            fn(x, weights[0], y)
            label = f"{kern['blocking']}{' split' if kern['split'] else ''}"
            errs[label] = float(np.abs(y.numpy() - ref).max() / np.abs(ref).max())
            passes[f"{label} cold"] = (lambda fn=fn: [fn(x, w, y) for w in weights])
            passes[f"{label} hot"] = (lambda fn=fn: [fn(x, weights[0], y) for _ in range(hot_reps)])
        for p in passes.values():
            p()
        times = timed_rounds(passes, rounds)
        flops = 2.0 * tokens * n * k
        for name, ts in times.items():
            per = min(ts) / len(weights)
            rows.append({"shape": [n, k], "variant": name, "ms": round(per * 1e3, 3),
                         "median_ms": round(float(np.median(ts)) / len(weights) * 1e3, 3),
                         "tflops": round(flops / per / 1e12, 2), "weight_gbs": round(n * k * 2 / per / 1e9, 1),
                         "rel_err": errs.get(name.rsplit(" ", 1)[0])})
    return {"tokens": tokens, "rounds": rounds, "rows": rows}


def main():
    ap = experiment_parser(__doc__, rounds=7)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    if built_only(a, build):
        return
    rep = run(a.run_only, a.rounds, a.tokens)
    print(json.dumps(rep))
    print(f"{'shape':>11} {'variant':>20} {'ms':>7} {'median':>7} {'TFLOPS':>7} {'W GB/s':>7} {'err':>8}")
    for r in rep["rows"]:
        err = f"{r['rel_err']:8.1e}" if r["rel_err"] is not None else ""
        print(f"{'x'.join(map(str, r['shape'])):>11} {r['variant']:>20} {r['ms']:>7} {r['median_ms']:>7} "
              f"{r['tflops']:>7} {r['weight_gbs']:>7} {err}")


if __name__ == "__main__":
    main()
