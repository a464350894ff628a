#!/usr/bin/env python3
"""Decode GEMV of the CPU stage against the DRAM ceiling and torch, for Qwen3-4B/8B/14B projection shapes.

For each (out, in) projection shape and weight dtype (fp16, bf16), one run measures, interleaved:
  dram   -- a parallel read of an fp32 buffer >= 4x L3 (helmc's stream-read kernel and torch's sum; the
            faster counts, so the ratio below is never flattered by a weak reference)
  helmc  -- helmc's GEMV (schedules/cpu/gemv.py), one token, fp32 accumulation
  torch  -- torch.nn.functional.linear on the same weights (same dtype, bf16/fp16 activations) and threads
Every timed pass cycles through enough copies of the weight to read >= 4x L3, so figures are DRAM, not
cache. Each figure is the best of --rounds passes (the machine may be shared).

  python scripts/bench_cpu_gemv.py [--models 8b] [--json]                  # build and run here
  python scripts/bench_cpu_gemv.py --build-only DIR --hardware hw.json     # compile for another CPU
  python scripts/bench_cpu_gemv.py --run-only DIR [--json]                 # there: tvm.runtime + torch only
`--json` prints {"dram_gbs": .., "results": [{"shape": [N, K], "dtype": .., "helmc_gbs": .., "torch_gbs": ..}]}.
Built for a CPU with AMX (amx_tile + amx_bf16), the bundle also holds the bf16 prefill GEMM on AMX tiles
(gemm_amx.py); --run-only then checks it against float64 and times it beside torch's bf16 linear
("amx_gemm" in the JSON).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

# name -> (hidden, intermediate, heads, kv_heads, head_dim): the published config.json of each model.
QWEN3 = {"4b": (2560, 9728, 32, 8, 128), "8b": (4096, 12288, 32, 8, 128), "14b": (5120, 17408, 40, 8, 128)}
DTYPES = ("float16", "bfloat16")
MANIFEST = "gemv_bench.json"
# Pause before every timed pass: torch's and TVM's worker threads keep spinning for a while after their last
# parallel region and slow whatever runs next on a machine with few cores (see bench_cpu_block.py).
SETTLE_S = 0.2


def projection_shapes(model: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of q, k/v, o, gate/up, down."""
    hidden, ffn, heads, kv_heads, head_dim = QWEN3[model]
    return [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (hidden, heads * head_dim),
            (ffn, hidden), (hidden, ffn)]


def l3_bytes() -> int:
    """Total last-level cache: the sum over distinct L3 instances listed in /sys."""
    seen = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*"):
        try:
            if open(os.path.join(index, "level")).read().strip() != "3":
                continue
            shared = open(os.path.join(index, "shared_cpu_list")).read().strip()
            size = open(os.path.join(index, "size")).read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        seen[shared] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sum(seen.values()) or (32 << 20)


def cpu_flags() -> tuple[str, ...]:
    from helmc.runtime.manifest import host_cpu_flags
    return tuple(sorted(host_cpu_flags()))


def target_features(args) -> tuple[tuple[str, ...], int]:
    """(CPU features to compile for, L3 bytes of the target): this CPU, or --hardware, or --features."""
    features, target_l3 = cpu_flags(), l3_bytes()
    if args.hardware:
        from helmc.hardware import HardwareProfile
        cpu = HardwareProfile.load(args.hardware).cpu
        features, target_l3 = cpu.features, cpu.l3_bytes
    if args.features:
        features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    return features, target_l3


def build(out_dir: str, features: tuple[str, ...], models: list[str], min_read_bytes: int) -> None:
    import tvm
    from helmc.schedule_cpu_stage import llvm_target, required_cpu_features
    from helmc.schedules.cpu.gemv import make_gemv
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements

    isa = select_isa(features)
    shapes = sorted({s for m in models for s in projection_shapes(m)})
    funcs, kernels = {}, []
    for n, k in shapes:
        for dtype in DTYPES:
            f = make_gemv(1, n, k, dtype, isa)
            name = str(f.attrs["global_symbol"])
            funcs[name] = f
            kernels.append({"name": name, "shape": [n, k], "dtype": dtype})
    amx = []
    if isa.has_amx_bf16:  # the prefill GEMM on AMX tiles: numerics and speed are checked where AMX exists
        from helmc.schedules.cpu.gemm_amx import amx_gemm_applies, make_gemm_amx
        for n, k in shapes:
            for dtype in DTYPES:
                if amx_gemm_applies(n, k, dtype, isa):
                    f = make_gemm_amx(n, k, dtype)
                    funcs[str(f.attrs["global_symbol"])] = f
                    amx.append({"name": str(f.attrs["global_symbol"]), "shape": [n, k], "dtype": dtype})
    read_elements = stream_read_elements(min_read_bytes, isa)
    funcs["helmc_stream_read"] = make_stream_read(read_elements, isa)
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, "gemv_bench.so"))
    manifest = {"isa": isa.tier, "required_flags": list(required_cpu_features(features)), "kernels": kernels,
                "amx_gemm_kernels": amx, "read_elements": read_elements}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def run(out_dir: str, threads: int, rounds: int, models: list[str] | None) -> dict:
    import numpy as np
    import torch
    import tvm.runtime
    from helmc.runtime.tvm_tensors import numpy_from_tensor, tensor_from_numpy  # noqa: F401

    manifest = json.load(open(os.path.join(out_dir, MANIFEST)))
    lacking = [f for f in manifest["required_flags"] if f not in cpu_flags()]
    if lacking:
        sys.exit(f"bench_cpu_gemv: kernels need CPU flags {lacking} that this CPU lacks")
    lib = tvm.runtime.load_module(os.path.join(out_dir, "gemv_bench.so"))
    torch.set_num_threads(threads)
    dev = tvm.runtime.cpu()
    min_bytes = 4 * l3_bytes()
    wanted = {s for m in models for s in projection_shapes(m)} if models else None

    read_n = manifest["read_elements"]
    read_buf = tvm.runtime.empty((read_n,), "float32", dev)
    read_buf.copyfrom(np.ones(read_n, np.float32))
    partial = tvm.runtime.empty((1024,), "float32", dev)
    torch_buf = torch.from_dlpack(read_buf)
    read_fn = lib["helmc_stream_read"]

    def best_gbs(fn, nbytes, reps=rounds):
        best = 0.0
        for _ in range(reps):
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            fn()
            best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
        return best

    read_fn(read_buf, partial)
    dram = max(best_gbs(lambda: read_fn(read_buf, partial), read_n * 4),
               best_gbs(lambda: torch_buf.sum(), read_n * 4))
    rng = np.random.default_rng(0)
    results = []
    for kern in manifest["kernels"]:
        n, k = kern["shape"]
        if wanted is not None and (n, k) not in wanted:
            continue
        dtype, nbytes = kern["dtype"], n * k * 2
        copies = max(1, -(-min_bytes // nbytes))
        base = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        if dtype == "bfloat16":
            from helmc.runtime.tvm_tensors import bf16_bits_from_float32
            host = bf16_bits_from_float32(base)
        else:
            host = base.astype(np.float16)
        weights = [tensor_from_numpy(host, dtype, dev) for _ in range(copies)]
        # torch gets its own allocations (same values), so nothing about TVM's buffers can slow it down.
        torch_weights = [torch.from_dlpack(w).clone() for w in weights]
        x32 = rng.standard_normal((1, k), dtype=np.float32)
        x, y = tensor_from_numpy(x32, "float32", dev), tvm.runtime.empty((1, n), "float32", dev)
        xt = torch.from_numpy(x32).to(torch_weights[0].dtype)
        fn = lib[kern["name"]]
        fn(x, weights[0], y)
        ref = x32.astype(np.float64) @ torch_weights[0].to(torch.float64).numpy().T
        err = float(np.abs(y.numpy() - ref).max() / np.abs(ref).max())

        def helmc_pass():
            for w in weights:
                fn(x, w, y)

        def torch_pass():
            for w in torch_weights:
                torch.nn.functional.linear(xt, w)

        torch_pass()
        helmc_gbs = torch_gbs = 0.0
        for _ in range(rounds):  # interleaved, so both see the same background load
            helmc_gbs = max(helmc_gbs, best_gbs(helmc_pass, nbytes * copies, 1))
            torch_gbs = max(torch_gbs, best_gbs(torch_pass, nbytes * copies, 1))
            dram = max(dram, best_gbs(lambda: read_fn(read_buf, partial), read_n * 4, 1))
        results.append({"shape": [n, k], "dtype": dtype, "helmc_gbs": round(helmc_gbs, 2),
                        "torch_gbs": round(torch_gbs, 2), "rel_err": err, "bytes_per_pass": nbytes * copies})
        del weights, torch_weights
    amx = [amx_gemm_check(lib[k["name"]], *k["shape"], k["dtype"], rounds) for k in manifest.get("amx_gemm_kernels", [])
           if wanted is None or tuple(k["shape"]) in wanted]
    return {"dram_gbs": round(dram, 2), "results": results, "threads": threads, "l3_bytes": l3_bytes(),
            "isa": manifest["isa"], "read_bytes": read_n * 4, "amx_gemm": amx}


def amx_gemm_check(fn, n: int, k: int, dtype: str, rounds: int, prompt: int = 128) -> dict:
    """The AMX prefill GEMM against float64 (odd token counts too) and against torch's linear in bf16 (the
    issue's reference) with the same weight values."""
    import numpy as np
    import torch
    import tvm.runtime
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, float32_from_bf16_bits, tensor_from_numpy
    dev = tvm.runtime.cpu()
    rng = np.random.default_rng(n + k)
    vals = rng.standard_normal((n, k), dtype=np.float32) * 0.02
    if dtype == "bfloat16":
        bits = bf16_bits_from_float32(vals)
        w, w64 = tensor_from_numpy(bits, dtype, dev), float32_from_bf16_bits(bits).astype(np.float64)
    else:
        w, w64 = tensor_from_numpy(vals.astype(dtype), dtype, dev), vals.astype(dtype).astype(np.float64)
    err = 0.0
    for tokens in (1, 5, 33, prompt):
        x32 = rng.standard_normal((tokens, k), dtype=np.float32)
        y = tvm.runtime.empty((tokens, n), "float32", dev)
        fn(tensor_from_numpy(x32, "float32", dev), w, y)
        ref = x32.astype(np.float64) @ w64.T
        err = max(err, float(np.abs(y.numpy() - ref).max() / np.abs(ref).max()))
    x, tw = tensor_from_numpy(x32, "float32", dev), torch.from_dlpack(w).to(torch.bfloat16)
    xt = torch.from_numpy(x32).to(torch.bfloat16)
    best, best_torch = 1e9, 1e9
    for _ in range(rounds):
        time.sleep(SETTLE_S)
        t = time.perf_counter()
        fn(x, w, y)
        best = min(best, time.perf_counter() - t)
        time.sleep(SETTLE_S)
        t = time.perf_counter()
        torch.nn.functional.linear(xt, tw)
        best_torch = min(best_torch, time.perf_counter() - t)
    flops = 2.0 * prompt * n * k
    return {"shape": [n, k], "dtype": dtype, "tokens": prompt, "rel_err": err, "helmc_ms": round(best * 1e3, 3),
            "torch_bf16_ms": round(best_torch * 1e3, 3), "helmc_tflops": round(flops / best / 1e12, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="4b,8b,14b", help="comma list of 4b, 8b, 14b")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build-only", metavar="DIR")
    ap.add_argument("--run-only", metavar="DIR")
    ap.add_argument("--hardware", help="hardware.json whose CPU features to compile for (default: this CPU)")
    ap.add_argument("--features", help="comma list of /proc/cpuinfo flags to compile for (default: this CPU)")
    ap.add_argument("--l3-bytes", type=int, help="size the DRAM read for this L3 (default: this machine's)")
    ap.add_argument("--threads", type=int, default=0, help="default: every core this process may use")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(threads)  # TVM's default is half the cores on x86
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in QWEN3:
            sys.exit(f"--models: expected names from {sorted(QWEN3)}, found {m!r}")
    if args.run_only:
        report = run(args.run_only, threads, args.rounds, models)
    else:
        features, target_l3 = target_features(args)
        out_dir = args.build_only or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"helmc_gemv_bench_{os.getpid()}")
        build(out_dir, features, models, 4 * (args.l3_bytes or target_l3))
        if args.build_only:
            print(f"built {out_dir}: run there with  python scripts/bench_cpu_gemv.py --run-only {out_dir}")
            return
        report = run(out_dir, threads, args.rounds, models)
    if args.json:
        print(json.dumps(report))
        return
    print(f"DRAM read {report['dram_gbs']:.1f} GB/s over {report['read_bytes'] >> 20} MiB "
          f"(L3 {report['l3_bytes'] >> 20} MiB), {threads} threads, ISA {report['isa']}")
    print(f"{'shape (N x K)':>16} {'dtype':>9} {'helmc GB/s':>11} {'% DRAM':>7} {'torch GB/s':>11} {'rel err':>9}")
    for r in report["results"]:
        n, k = r["shape"]
        print(f"{n:>7} x {k:<7}{r['dtype']:>9} {r['helmc_gbs']:>11.1f} {100 * r['helmc_gbs'] / report['dram_gbs']:>6.0f}%"
              f" {r['torch_gbs']:>11.1f} {r['rel_err']:>9.1e}")
    for r in report["amx_gemm"]:
        n, k = r["shape"]
        print(f"AMX GEMM {n} x {k} {r['dtype']}, {r['tokens']} tokens: {r['helmc_ms']:.2f} ms ({r['helmc_tflops']:.1f} TFLOPS), "
              f"torch bf16 {r['torch_bf16_ms']:.2f} ms; rel err vs float64 {r['rel_err']:.1e} (tokens 1/5/33/128)")


if __name__ == "__main__":
    main()
