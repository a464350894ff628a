#!/usr/bin/env python3
"""What a batched decode step costs on the CPU stage against a single one, built and run here.

  gemv   the decode GEMVs (schedules/cpu/gemv.py for fp16 / bf16, gemv_quant.py for the quantized types) at
         Qwen3-8B's projection shapes for m = 1, 2, 4, 8 rows of x: GB/s of weight bytes read, cycling through
         weight copies of >= 4x L3 so every call reads DRAM; beside it the stream read of the same arena
         (bench_cpu_gemv.WeightArena). Batch invariance makes the m-row kernel read each weight once and form
         each row as the 1-row kernel does; this shows what the extra rows cost.
  block  one Qwen3-8B block's decode step (pre_attn + post_attn, the pipeline's own export compiled by
         compile_cpu_stage with the batched variants) for 1 row (decode) and for 8 (decode_b8): ms per step
         and per token.
Each figure is the best of --rounds interleaved passes (the machine may be shared), the median beside it.

  python -m benchmarks.bench_batch_decode [--what gemv,block] [--dtype float16] [--quant q4_k,q8_0] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.bench_cpu_gemv import (WeightArena, arena_bytes, cpu_flags, l3_bytes, projection_shapes,
                                       timed_rounds)

ROWS = (1, 2, 4, 8)


def _stat(seconds: list[float], nbytes: int) -> dict:
    gbs = [nbytes / t / 1e9 for t in seconds]
    return {"gbs": round(max(gbs), 2), "gbs_median": round(float(np.median(gbs)), 2),
            "ms": round(min(seconds) * 1e3, 3), "ms_median": round(float(np.median(seconds)) * 1e3, 3)}


def bench_gemv(types: list[str], rounds: int) -> dict:
    import tvm
    import tvm.runtime
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
    from helmc.schedules.cpu.gemv import make_gemv
    from helmc.schedules.cpu.gemv_quant import quant_row_bytes
    from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements

    features = cpu_flags()
    isa, target, dev = select_isa(features), llvm_target(features), tvm.cpu()
    min_bytes = 4 * l3_bytes()
    read_n = stream_read_elements(min_bytes, isa)
    reader = tvm.compile(make_stream_read(read_n, isa), target=target)
    shapes = sorted(set(projection_shapes("8b")))
    arena = WeightArena(arena_bytes(read_n * 4, [max(min_bytes, n * k * 2) + n * k * 2 for n, k in shapes]))
    buf = arena.tensor((read_n,), "float32")
    part = tvm.runtime.empty((1024,), "float32", dev)
    read_fn = reader["helmc_stream_read"]
    rng = np.random.default_rng(0)
    out = {"isa": isa.tier, "threads": int(os.environ.get("TVM_NUM_THREADS", "0")), "cases": []}
    for qtype in types:
        for n, k in shapes:
            if qtype in ("float16", "bfloat16"):
                host = rng.standard_normal((n, k), dtype=np.float32).astype(np.float16)
                host = host.view(np.uint16) if qtype == "bfloat16" else host
                store = qtype
                make = lambda m: make_gemv(m, n, k, qtype, isa)  # noqa: E731
            else:
                from tests.quant_rows import random_quant_rows    # valid rows: finite scales, no denormals
                host = random_quant_rows(qtype, n, k, rng)
                assert host.shape == (n, quant_row_bytes(qtype, k))
                store = "uint8"
                make = lambda m: make_gemv_quant(qtype, n, k, isa, m=m)  # noqa: E731
            nbytes = host.nbytes
            copies = max(1, -(-min_bytes // nbytes))
            arena.reset()                  # copies from the start: the DRAM read streams the pages they are on
            ws = [arena.place(host, store) for _ in range(copies)]
            funcs = {m: make(m) for m in ROWS}
            lib = tvm.compile(tvm.IRModule({str(f.attrs["global_symbol"]): f for f in funcs.values()}), target=target)
            passes = {"dram": lambda: read_fn(buf, part)}
            for m, f in funcs.items():
                fn = lib[str(f.attrs["global_symbol"])]
                x = tvm.runtime.tensor(rng.standard_normal((m, k), dtype=np.float32), dev)
                y = tvm.runtime.empty((m, n), "float32", dev)
                passes[m] = (lambda fn=fn, x=x, y=y: [fn(x, w, y) for w in ws])
                passes[m]()
            times = timed_rounds(passes, rounds)
            case = {"type": qtype, "shape": [n, k], "dram": _stat(times["dram"], read_n * 4)}
            case.update({f"m{m}": _stat([t / copies for t in times[m]], nbytes) for m in ROWS})
            for m in ROWS:       # the m-row call's time over the one-row call's (weight bytes are the same)
                case[f"m{m}"]["time_over_m1"] = round(case[f"m{m}"]["ms"] / case["m1"]["ms"], 3)
            out["cases"].append(case)
            print(f"{qtype:8s} {n:>5d}x{k:<5d} DRAM {case['dram']['gbs']:6.1f} GB/s | " + " | ".join(
                f"m={m} {case[f'm{m}']['gbs']:6.1f} GB/s ({case[f'm{m}']['time_over_m1']:.2f}x)" for m in ROWS),
                flush=True)
    return out


def bench_block(dtype: str, rounds: int) -> dict:
    import tvm
    import tvm.runtime
    from benchmarks.bench_cpu_block import qwen3_spec
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.passes.schedule_cpu_stage import compile_cpu_stage
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32

    spec = qwen3_spec("8b", dtype)
    exported = tuple(f for f in export_functions(spec) if f.name in ("pre_attn", "post_attn"))
    t0 = time.time()
    vm = tvm.runtime.vm.VirtualMachine(compile_cpu_stage(import_functions(exported, (8,)), cpu_flags()), tvm.cpu())
    compile_s = time.time() - t0
    shapes = spec.block_weight_shapes()
    names = {f.name: list(f.weight_names) for f in exported}
    rng = np.random.default_rng(0)
    host = {}
    for n in names["pre_attn"] + names["post_attn"]:
        vals = (1.0 + 0.1 * rng.standard_normal(shapes[n], dtype=np.float32)) if len(shapes[n]) == 1 else \
            rng.standard_normal(shapes[n], dtype=np.float32) / np.sqrt(shapes[n][1])
        host[n] = bf16_bits_from_float32(vals) if dtype == "bfloat16" else vals.astype(dtype)
    w_param = sum(a.nbytes for a in host.values())
    arena = WeightArena(w_param + 64 * WeightArena.ALIGN)
    ws = {n: arena.place(a, dtype) for n, a in host.items()}
    H, D, Q = spec.hidden_size, spec.head_dim, spec.q_dim

    def step(phase, m):
        x, cos, sin, attn = (tvm.runtime.tensor(rng.standard_normal(s, dtype=np.float32)) for s in
                             ((m, H), (m, D), (m, D), (m, Q)))
        pre, post = vm[f"pre_attn_{phase}"], vm[f"post_attn_{phase}"]
        return lambda: (pre(x, cos, sin, *[ws[n] for n in names["pre_attn"]]),
                        post(x, attn, *[ws[n] for n in names["post_attn"]]))

    times = timed_rounds({"decode": step("decode", 1), "decode_b8": step("decode_b8", 8)}, rounds)
    r = {"dtype": dtype, "w_param_bytes": w_param, "compile_s_with_b8": round(compile_s, 1),
         "decode": _stat(times["decode"], w_param), "decode_b8": _stat(times["decode_b8"], w_param)}
    r["b8_over_decode"] = round(r["decode_b8"]["ms"] / r["decode"]["ms"], 3)
    print(f"Qwen3-8B block, {dtype}, {w_param / 1e6:.0f} MB: decode {r['decode']['ms']:.2f} ms "
          f"({r['decode']['gbs']:.1f} GB/s); decode_b8 {r['decode_b8']['ms']:.2f} ms per step of 8 "
          f"({r['decode_b8']['ms'] / 8:.2f} ms per token) = {r['b8_over_decode']:.2f}x the 1-row step")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="gemv,block")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--quant", default="q4_k,q8_0", help="quantized types of the gemv part ('' for none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-rows", type=int, default=None,
                    help="weight rows per step of the float GEMVs for m > 1 (default: gemv.BATCH_ROWS)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.batch_rows is not None:     # benchmark-only switch (schedules/cpu/gemv.py)
        from helmc.schedules.cpu import gemv as gemv_module
        gemv_module.BATCH_ROWS = a.batch_rows
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    report = {}
    if "gemv" in a.what:
        report["gemv"] = bench_gemv([a.dtype] + [q for q in a.quant.split(",") if q], a.rounds)
    if "block" in a.what:
        report["block"] = bench_block(a.dtype, a.rounds)
    if a.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
