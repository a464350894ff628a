#!/usr/bin/env python3
"""Decode attention of one CPU-stage layer at long contexts: the compiled kernel over 16-bit KV against the NumPy
fp32 path it replaces and against the machine's DRAM read bandwidth, for Qwen3-8B's layer (32 query heads,
8 KV heads, head_dim 128).

For each context (default 1K, 8K, 32K) one run measures, interleaved:
  dram       -- helmc's parallel stream read (schedules/cpu/stream_read.py) of an fp32 buffer >= 4x L3
  kernel     -- KVCacheCPU.attend with the compiled kernel (schedules/cpu/decode_attention.py), fp16 and bf16 KV
  numpy_fp32 -- KVCacheCPU.attend over an fp32 arena without a kernel (the path before the kernel)
Before every timed call a read of >= 2x L3 evicts the KV from the caches (between two decode steps the layer's
weights stream through them), so the figures are DRAM figures; --in-cache instead runs the call once untimed
first (KV that fits the caches stays there: the kernel's compute-bound speed). GB/s = K + V bytes of the context in the
cache's dtype / time. Each figure is the median of --rounds calls (the machine may be shared).

  python -m benchmarks.bench_cpu_attention [--contexts 1024,8192,32768] [--json]      # build and run here
  python -m benchmarks.bench_cpu_attention --build DIR --hardware hw.json             # compile for another CPU
  python -m benchmarks.bench_cpu_attention --run-only DIR [--json]                    # there: tvm.runtime only
`--json` prints {"dram_gbs": .., "results": [{"context": n, "dtype": .., "ms": .., "gbs": .., ...}]}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.bench_cpu_gemv import cpu_flags, l3_bytes

H_A, H_KV, D = 32, 8, 128          # Qwen3-8B
DTYPES = ("float16", "bfloat16")
LIB, MANIFEST = "attn_bench.so", "attn_bench.json"
SETTLE_S = 0.05                     # let TVM's spinning pool threads go idle before the next timed call


def build(out_dir: str, features: tuple[str, ...], cores: int, target_l3: int) -> None:
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target, required_cpu_features
    from helmc.schedules.cpu.decode_attention import default_max_splits, make_decode_attention
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements

    isa = select_isa(features)
    splits = default_max_splits(cores, H_KV)
    funcs, kernels = {}, []
    for dtype in DTYPES:
        f = make_decode_attention(H_A, H_KV, D, dtype, isa, splits)
        funcs[str(f.attrs["global_symbol"])] = f
        kernels.append({"name": str(f.attrs["global_symbol"]), "dtype": dtype})
    read_elements = stream_read_elements(4 * target_l3, isa)
    funcs["helmc_stream_read"] = make_stream_read(read_elements, isa)
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, LIB))
    manifest = {"isa": isa.tier, "required_flags": list(required_cpu_features(features)), "kernels": kernels,
                "read_elements": read_elements, "max_splits": splits, "shape": [H_A, H_KV, D]}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def run(out_dir: str, threads: int, rounds: int, contexts: list[int], paths: tuple[str, ...],
        in_cache: bool = False) -> dict:
    import numpy as np
    import tvm.runtime
    from helmc.runtime.kv.cache_cpu import KVCacheCPU
    from helmc.runtime.tvm_tensors import single_threaded_blas

    manifest = json.load(open(os.path.join(out_dir, MANIFEST)))
    lacking = [f for f in manifest["required_flags"] if f not in cpu_flags()]
    if lacking:
        sys.exit(f"bench_cpu_attention: kernels need CPU flags {lacking} that this CPU lacks")
    single_threaded_blas()                     # as the session: the NumPy path threads its own calls
    lib = tvm.runtime.load_module(os.path.join(out_dir, LIB))
    dev = tvm.runtime.cpu()
    read_n = manifest["read_elements"]
    read_buf = tvm.runtime.empty((read_n,), "float32", dev)
    read_buf.copyfrom(np.ones(read_n, np.float32))
    partial = tvm.runtime.empty((1024,), "float32", dev)
    read_fn = lib["helmc_stream_read"]
    read_fn(read_buf, partial)

    def evict():
        read_fn(read_buf, partial)             # >= 4x L3 (stream_read_elements of 4x the target's L3)

    def dram_gbs() -> float:
        time.sleep(SETTLE_S)
        t = time.perf_counter()
        read_fn(read_buf, partial)
        return read_n * 4 / (time.perf_counter() - t) / 1e9

    rng = np.random.default_rng(0)
    top = max(contexts)
    # One block of random rows repeated up to the longest context (random data for 32K rows is slow to make).
    block = rng.standard_normal((2, 1024, H_KV, D), dtype=np.float32)
    q = rng.standard_normal((1, H_A, D), dtype=np.float32)
    caches = {}
    for path in paths:
        dtype = "float32" if path == "numpy_fp32" else path
        kernel = None
        if dtype != "float32":
            kernel = lib[next(k["name"] for k in manifest["kernels"] if k["dtype"] == dtype)]
        caches[path] = KVCacheCPU(num_layers=1, num_kv_heads=H_KV, head_dim=D, page_tokens=512,
                                  max_tokens=top + rounds * len(contexts) + 8, dtype=dtype, threads=threads,
                                  attend_kernel=kernel)
    results, dram = [], []
    for ctx in contexts:
        for cache in caches.values():          # fill to ctx - 1 tokens; every timed step appends one
            cache.reset()
            for a in range(0, ctx - 1, 1024):
                rows = min(1024, ctx - 1 - a)
                cache.append(0, block[0, :rows], block[1, :rows])
                cache.advance(rows)
        times = {p: [] for p in caches}
        ref = None
        for _ in range(rounds):                # interleaved, so every path sees the same background load
            dram.append(dram_gbs())
            for path, cache in caches.items():
                cache.append(0, block[0, :1], block[1, :1])
                if in_cache:
                    cache.attend(0, q, D ** -0.5)   # warm: the KV (if it fits) and the code in the caches
                else:
                    evict()
                time.sleep(SETTLE_S)
                t = time.perf_counter()
                o = cache.attend(0, q, D ** -0.5)
                times[path].append(time.perf_counter() - t)
                cache.advance(1)
                if path == "numpy_fp32":
                    ref = o
        for path, cache in caches.items():
            ms = statistics.median(times[path]) * 1e3
            n = cache.length
            kv_bytes = 2 * H_KV * n * D * cache.dtype.itemsize
            results.append({"context": ctx, "path": "numpy" if path == "numpy_fp32" else "kernel",
                            "dtype": cache.kv_dtype, "ms": round(ms, 4), "best_ms": round(min(times[path]) * 1e3, 4),
                            "gbs": round(kv_bytes / ms / 1e6, 2), "kv_bytes": kv_bytes})
    for cache in caches.values():
        cache.close()
    return {"dram_gbs": round(max(dram), 2), "dram_median_gbs": round(statistics.median(dram), 2),
            "results": results, "threads": threads, "isa": manifest["isa"], "max_splits": manifest["max_splits"],
            "l3_bytes": l3_bytes(), "read_bytes": read_n * 4, "shape": manifest["shape"], "in_cache": in_cache}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192,32768", help="comma list of context lengths")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build", metavar="DIR", help="compile into DIR and stop (for --run-only elsewhere)")
    ap.add_argument("--run-only", metavar="DIR")
    ap.add_argument("--hardware", help="hardware.json whose CPU (features, cores, L3) to compile for "
                                       "(default: this CPU)")
    ap.add_argument("--threads", type=int, default=0, help="default: every core this process may use")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--in-cache", action="store_true", help="warm the KV into the caches before each timed call "
                                                           "instead of evicting it (compute-bound figures)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the NumPy fp32 path (slow at long contexts)")
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(threads)  # TVM's default is half the cores on x86
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    if not contexts or min(contexts) < 2:
        sys.exit(f"--contexts: expected context lengths >= 2, found {args.contexts!r}")
    paths = DTYPES + (() if args.no_numpy else ("numpy_fp32",))
    if args.run_only:
        report = run(args.run_only, threads, args.rounds, contexts, paths, args.in_cache)
    else:
        features, cores, target_l3 = cpu_flags(), threads, l3_bytes()
        if args.hardware:
            from helmc.hardware.profile import HardwareProfile
            cpu = HardwareProfile.load(args.hardware).cpu
            features, cores, target_l3 = cpu.features, cpu.cores, cpu.l3_bytes
        out_dir = args.build or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"helmc_attn_bench_{os.getpid()}")
        build(out_dir, features, cores, target_l3)
        if args.build:
            size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
            print(f"built {out_dir} ({size / 1e6:.2f} MB): run there with  "
                  f"python -m benchmarks.bench_cpu_attention --run-only {out_dir}")
            return
        report = run(out_dir, threads, args.rounds, contexts, paths, args.in_cache)
    if args.json:
        print(json.dumps(report))
        return
    print(f"DRAM read {report['dram_gbs']:.1f} GB/s (median {report['dram_median_gbs']:.1f}) over "
          f"{report['read_bytes'] >> 20} MiB, {threads} threads, ISA {report['isa']}, "
          f"layer h_a {H_A} h_kv {H_KV} d {D}, splits <= {report['max_splits']} per KV head")
    print(f"{'context':>8} {'path':>7} {'KV dtype':>9} {'ms/layer':>9} {'GB/s':>7} {'% DRAM':>7}")
    for r in report["results"]:
        print(f"{r['context']:>8} {r['path']:>7} {r['dtype']:>9} {r['ms']:>9.3f} {r['gbs']:>7.1f} "
              f"{100 * r['gbs'] / report['dram_gbs']:>6.0f}%")


if __name__ == "__main__":
    main()
