#!/usr/bin/env python3
"""Decode GEMV of the CPU stage against the DRAM ceiling and torch, for Qwen3-4B/8B/14B projection shapes.

For each (out, in) projection shape and weight type (--types: fp16, bf16; also q8_0, q4_0, q4_k, q6_k), one
run measures, interleaved:
  dram   -- a parallel read of an fp32 buffer >= 4x L3 (helmc's stream-read kernel and torch's sum; the
            faster counts, so the ratio below is never flattered by a weak reference)
  helmc  -- helmc's GEMV (schedules/cpu/gemv.py, quant/decode_gemv.py), one token, fp32 accumulation
  m{m}   -- with --m 1,2,4,8: the m-row GEMV (a batched decode step) on the same copies: GB/s of weight
            bytes, its time over the one-token call's ("time_over_m1") and whether its rows are bit-identical
  torch  -- torch.nn.functional.linear on the same weights (same dtype, bf16/fp16 activations) and threads
Every timed pass cycles through enough copies of the weight to read >= 4x L3, so figures are DRAM, not
cache; all read the very same copies (same pages), in interleaved rounds whose order alternates.
The copies and the DRAM read's buffer share one allocation (WeightArena): the read streams the pages the
kernels stream, since on a VM guest the speed of a buffer depends on where the host placed its pages.
  pages  -- the same stream read over the very weight copies of the case, viewed as fp32 (placement differs
            between allocations: on the GPU machine whole cases ran 40% slower for helmc and torch alike)
Each figure is the best of --rounds passes (the machine may be shared), the median beside it.
--huge-pages advises that allocation MADV_HUGEPAGE (the runtime itself does not place weights there).

  python -m benchmarks.bench_cpu_gemv [--models 8b] [--m 1,2,4,8] [--types float16,q4_k] [--json]   # here
  python -m benchmarks.bench_cpu_gemv --build-only DIR --hardware hw.json     # compile for another CPU
  python -m benchmarks.bench_cpu_gemv --run-only DIR [--json]                 # there: tvm.runtime + torch only
The DRAM figure of each case is the best read in that case's own rounds ("dram_gbs_case"): on a shared host
the bandwidth left to this process drifts over a run (GPU machine: 110-171 GB/s between cases read
from the same allocation); the run's best read ("dram_gbs") is reported beside it.
`--json` prints {"dram_gbs": .., "results": [{"shape": [N, K], "dtype": .., "helmc_gbs": .., "torch_gbs": ..,
"dram_gbs_case": .., "m_rows": [{"m", "gbs", "time_over_m1", "rows_equal_m1"}], ...}]}.
Built for a CPU with AMX (amx_tile + amx_bf16), the bundle also holds the prefill GEMM on AMX tiles
(gemm_amx.py): the default blocking for every shape and the alternatives of BLOCKING_VARIANTS for the
--amx-variants models' shapes. --run-only checks each against float64 (1 to 200 tokens) and times it on a
128-token prompt beside torch's bf16 linear ("amx_gemm" in the JSON, one entry per shape and dtype).
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
    """Total last-level cache of the CPUs this process may use (helmc profile's reading), 32 MiB if none."""
    from helmc.hardware.measure import allowed_cpus, l3_total_bytes
    return l3_total_bytes(allowed_cpus())[0] or (32 << 20)


def cpu_flags() -> tuple[str, ...]:
    from helmc.runtime.bundle.manifest import host_cpu_flags
    return tuple(sorted(host_cpu_flags()))


def target_features(args) -> tuple[tuple[str, ...], int]:
    """(CPU features to compile for, L3 bytes of the target): this CPU, or --hardware, or --features."""
    features, target_l3 = cpu_flags(), l3_bytes()
    if args.hardware:
        from helmc.hardware.profile import HardwareProfile
        cpu = HardwareProfile.load(args.hardware).cpu
        features, target_l3 = cpu.features, cpu.l3_bytes
    if args.features:
        features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    return features, target_l3


def experiment_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments every build-here / run-there experiment script takes (bench_gemv_layout, profile_amx_gemm,
    profile_amx_tiles); each adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-only", metavar="DIR")
    ap.add_argument("--run-only", metavar="DIR")
    ap.add_argument("--hardware", help="hardware.json whose CPU features to compile for (default: this CPU)")
    ap.add_argument("--features", help="comma list of /proc/cpuinfo flags to compile for (default: this CPU)")
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def built_only(args, build) -> bool:
    """--build-only: build(DIR, target features) and True. Otherwise False, with TVM set to run on every core
    this process may use (its default is half the cores on x86)."""
    if args.build_only:
        build(args.build_only, target_features(args)[0])
        return True
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    return False


def build(out_dir: str, features: tuple[str, ...], models: list[str], min_read_bytes: int,
          amx_variant_models: list[str], gemv_prefetch: int | None = None, types: tuple[str, ...] = DTYPES,
          rows: tuple[int, ...] = (1,)) -> None:
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target, required_cpu_features
    from helmc.schedules.cpu import gemv as gemv_module
    from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements
    if gemv_prefetch is not None:   # benchmark-only switch (schedules/cpu/gemv.py)
        gemv_module.PREFETCH_STEPS = gemv_prefetch
    gemv_prefetch = gemv_module.PREFETCH_STEPS
    isa = select_isa(features)
    shapes = sorted({s for m in models for s in projection_shapes(m)})
    funcs, kernels = {}, []
    for n, k in shapes:
        for dtype in types:
            by_m = []
            for m in sorted({1, *rows}):     # m = 1 first: the other m are timed against it
                f = gemv_module.make_gemv(m, n, k, dtype, isa) if dtype in DTYPES else \
                    make_gemv_quant(dtype, n, k, isa, m=m)
                funcs[str(f.attrs["global_symbol"])] = f
                by_m.append({"m": m, "name": str(f.attrs["global_symbol"])})
            kernels.append({"name": by_m[0]["name"], "shape": [n, k], "dtype": dtype, "m": by_m})
    amx = []
    if isa.has_amx_bf16:  # the prefill GEMM on AMX tiles: numerics and speed are checked where AMX exists
        from helmc.schedules.cpu.gemm_amx import BLOCKING_VARIANTS, amx_gemm_applies, make_gemm_amx
        variant_shapes = {s for m in amx_variant_models for s in projection_shapes(m)}
        for n, k in shapes:
            for dtype in DTYPES:
                if not amx_gemm_applies(n, k, dtype, isa):
                    continue
                entry = {"shape": [n, k], "dtype": dtype, "variants": []}
                for blocking in BLOCKING_VARIANTS if (n, k) in variant_shapes else BLOCKING_VARIANTS[:1]:
                    f = make_gemm_amx(n, k, dtype, blocking=blocking)
                    funcs[str(f.attrs["global_symbol"])] = f
                    entry["variants"].append({"name": str(f.attrs["global_symbol"]),
                                              "blocking": blocking.name or "default"})
                amx.append(entry)
    read_elements = stream_read_elements(min_read_bytes, isa)
    funcs["helmc_stream_read"] = make_stream_read(read_elements, isa)
    page_reads = sorted({n * k // 2 for n, k in shapes if n * k // 2 == stream_read_elements(n * k * 2, isa)})
    for elements in page_reads:   # one weight copy as fp32 (bf16/fp16 are 2 bytes)
        funcs[f"helmc_stream_read_{elements}"] = make_stream_read(elements, isa).with_attr(
            "global_symbol", f"helmc_stream_read_{elements}")
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, "gemv_bench.so"))
    manifest = {"isa": isa.tier, "required_flags": list(required_cpu_features(features)), "kernels": kernels,
                "amx_gemm_kernels": amx, "read_elements": read_elements, "page_read_elements": page_reads,
                "gemv_prefetch": gemv_prefetch}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def machine_notes() -> dict:
    """What can make DRAM figures differ between runs: CPU model, NUMA nodes, transparent huge pages."""
    notes = {"numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*"))}
    try:
        notes["thp"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        pass
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            notes["cpu"] = line.split(":", 1)[1].strip()
            break
    return notes


class WeightArena:
    """One fresh allocation holding the DRAM read's buffer and every weight copy a bench times, so the read
    and the kernels stream the very same pages.

    Why: on the GPU machine's VM guest the read speed of a buffer differed between allocations (16 threads: the same stream read over some cases' weight copies gave 85-123 GB/s, over others 140-182,
    the 1.2 GB read buffer 175-191). Reading both from one allocation makes "kernel GB/s over DRAM GB/s"
    compare the kernel with the memory it reads.
    The read covers the arena's first bytes; copies are placed from the start, 4 KiB-aligned."""

    ALIGN = 4096

    def __init__(self, nbytes: int, huge_pages: bool = False):
        from helmc.runtime.weights.host_memory import huge_page_buffer
        self.region = huge_page_buffer(nbytes, advise=huge_pages)
        self.region.fill(0x3C)   # touch every page now; as fp32, 0x3c3c3c3c is a normal number (no denormal sums)
        self.used = 0

    def reset(self) -> None:
        """Place the next copies from the start again (the tensors of earlier copies are overwritten)."""
        self.used = 0

    def tensor(self, shape, dtype: str):
        from helmc.runtime.weights.host_memory import cpu_tensor_over, tensor_bytes
        start = -(-self.used // self.ALIGN) * self.ALIGN
        nbytes = tensor_bytes(tuple(shape), dtype)
        if start + nbytes > self.region.nbytes:
            raise ValueError(f"WeightArena: {nbytes} bytes expected to fit at offset {start}, found "
                             f"{self.region.nbytes} bytes in all")
        self.used = start + nbytes
        return cpu_tensor_over(self.region[start:], tuple(shape), dtype)

    def place(self, host, dtype: str):
        """A tensor in the arena holding `host` (bf16: raw uint16 bits, as tvm_tensors takes them)."""
        out = self.tensor(host.shape, dtype)
        storage = "uint16" if dtype == "bfloat16" else dtype
        out._create_view(tuple(host.shape), storage).copyfrom(host)
        return out


def arena_bytes(read_bytes: int, case_bytes: list[int]) -> int:
    """Bytes an arena needs for the DRAM read and the largest case's copies, each 4 KiB-aligned."""
    return max([read_bytes] + [c + 64 * WeightArena.ALIGN for c in case_bytes])


def weight_copies(rng, n: int, k: int, dtype: str, min_bytes: int, arena: WeightArena) -> tuple[list, object]:
    """(copies of one random [n, k] weight whose total is >= min_bytes, placed from the start of `arena`,
    float64 of its values; None for a quantized type, whose copies are valid GGUF rows, uint8 [n, row bytes])."""
    import numpy as np
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, float32_from_bf16_bits
    if dtype not in DTYPES:
        from tests.quant_rows import random_quant_rows
        host = random_quant_rows(dtype, n, k, rng)
        arena.reset()
        return [arena.place(host, "uint8") for _ in range(max(1, -(-min_bytes // host.nbytes)))], None
    base = rng.standard_normal((n, k), dtype=np.float32) * 0.02
    if dtype == "bfloat16":
        host = bf16_bits_from_float32(base)
        w64 = float32_from_bf16_bits(host).astype(np.float64)
    else:
        host = base.astype(np.float16)
        w64 = host.astype(np.float64)
    arena.reset()
    return [arena.place(host, dtype) for _ in range(copy_count(n, k, min_bytes))], w64


def copy_count(n: int, k: int, min_bytes: int) -> int:
    return max(1, -(-min_bytes // (n * k * 2)))


def timed_rounds(fns: dict, rounds: int) -> dict:
    """name -> seconds of each round's pass; rounds interleave the functions, alternating their order, each
    after a pause so that the previous one's spinning worker threads are asleep."""
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return times


def run(out_dir: str, threads: int, rounds: int, models: list[str] | None, huge_pages: bool = False) -> dict:
    import numpy as np
    import torch
    import tvm.runtime
    from helmc.runtime.weights.host_memory import anon_huge_page_bytes, cpu_tensor_over
    from helmc.runtime.tvm_tensors import tensor_from_numpy

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
    cases = [tuple(kern["shape"]) for kern in manifest["kernels"] + manifest.get("amx_gemm_kernels", [])
             if wanted is None or tuple(kern["shape"]) in wanted]
    # room for one more fp16 copy: a quantized type's copies may pass min_bytes by most of one
    arena = WeightArena(arena_bytes(read_n * 4, [(copy_count(n, k, min_bytes) + 1) * n * k * 2 for n, k in cases]),
                        huge_pages)
    read_buf = cpu_tensor_over(arena.region, (read_n,), "float32")
    partial = tvm.runtime.empty((1024,), "float32", dev)
    torch_buf = torch.from_dlpack(read_buf)
    read_fn = lib["helmc_stream_read"]
    read_fn(read_buf, partial)
    reads = timed_rounds({"helmc": lambda: read_fn(read_buf, partial), "torch": lambda: torch_buf.sum()}, rounds)
    dram_all = [read_n * 4 / t / 1e9 for ts in reads.values() for t in ts]
    rng = np.random.default_rng(0)
    results = []
    for kern in manifest["kernels"]:
        n, k = kern["shape"]
        if wanted is not None and (n, k) not in wanted:
            continue
        dtype = kern["dtype"]
        weights, w64 = weight_copies(rng, n, k, dtype, min_bytes, arena)
        nbytes, quant = weights[0].numel() * weights[0].dtype.bits // 8, w64 is None
        on_huge = anon_huge_page_bytes()
        # torch reads the same memory as helmc, and the DRAM read covers it: placement of pages favours none.
        torch_weights = [] if quant else [torch.from_dlpack(w) for w in weights]
        by_m = kern.get("m", [{"m": 1, "name": kern["name"]}])
        x_all = rng.standard_normal((by_m[-1]["m"], k), dtype=np.float32)
        x32 = x_all[:1]                                   # the one-token call's x: row 0 of the m-row calls'
        x, y = tensor_from_numpy(x32, "float32", dev), tvm.runtime.empty((1, n), "float32", dev)
        fn = lib[kern["name"]]
        fn(x, weights[0], y)
        err = None
        if not quant:
            ref = x32.astype(np.float64) @ w64.T
            err = float(np.abs(y.numpy() - ref).max() / np.abs(ref).max())
            xt = torch.from_numpy(x32).to(torch_weights[0].dtype)
        m_calls, m_equal = m_row_calls(lib, kern["name"], by_m[1:], x_all, weights, n, dev)

        def helmc_pass():
            for w in weights:
                fn(x, w, y)

        def torch_pass():
            for w in torch_weights:
                torch.nn.functional.linear(xt, w)

        passes = {"helmc": helmc_pass, "dram": lambda: read_fn(read_buf, partial), **m_calls,
                  **({} if quant else {"torch": torch_pass})}
        if not quant and n * k // 2 in manifest.get("page_read_elements", []):
            page_fn = lib[f"helmc_stream_read_{n * k // 2}"]
            views = [w._create_view((n * k // 2,), "float32") for w in weights]   # [n, k] 16-bit -> [n k / 2] fp32

            def pages_pass():
                for v in views:
                    page_fn(v, partial)
            passes["pages"] = pages_pass
        passes.get("torch", lambda: None)()
        times = timed_rounds(passes, rounds)
        dram_all += [read_n * 4 / t / 1e9 for t in times["dram"]]
        gbs = {name: [nbytes * len(weights) / t / 1e9 for t in ts] for name, ts in times.items() if name != "dram"}
        gbs.setdefault("torch", [float("nan")])
        dram_case = max(read_n * 4 / t / 1e9 for t in times["dram"])   # this case's rounds, same pages
        pages = {"pages_read_gbs": round(max(gbs["pages"]), 2),
                 "pages_read_gbs_median": round(float(np.median(gbs["pages"])), 2),
                 "helmc_over_pages_read": round(max(gbs["helmc"]) / max(gbs["pages"]), 3)} if "pages" in gbs else {}
        results.append({"shape": [n, k], "dtype": dtype, "helmc_gbs": round(max(gbs["helmc"]), 2), **pages,
                        "dram_gbs_case": round(dram_case, 2),
                        "helmc_over_dram_case": round(max(gbs["helmc"]) / dram_case, 3),
                        "torch_gbs": round(max(gbs["torch"]), 2),
                        "helmc_gbs_median": round(float(np.median(gbs["helmc"])), 2),
                        "torch_gbs_median": round(float(np.median(gbs["torch"])), 2),
                        "rel_err": err, "bytes_per_pass": nbytes * len(weights), "anon_huge_page_bytes": on_huge,
                        "m_rows": [{"m": e["m"], "gbs": round(max(gbs[f"m{e['m']}"]), 2),
                                    "gbs_median": round(float(np.median(gbs[f"m{e['m']}"])), 2),
                                    "time_over_m1": round(max(gbs["helmc"]) / max(gbs[f"m{e['m']}"]), 3),
                                    "rows_equal_m1": m_equal[e["m"]]} for e in by_m[1:]]})
        del weights, torch_weights
    amx = [amx_gemm_check(lib, entry, rounds, min_bytes, arena) for entry in manifest.get("amx_gemm_kernels", [])
           if wanted is None or tuple(entry["shape"]) in wanted]
    return {"dram_gbs": round(max(dram_all), 2), "dram_gbs_median": round(float(np.median(dram_all)), 2),
            "results": results, "threads": threads, "l3_bytes": l3_bytes(), "isa": manifest["isa"],
            "read_bytes": read_n * 4, "statistic": f"best of {rounds} interleaved rounds (median in *_median)",
            "machine": machine_notes(), "amx_gemm": amx, "huge_pages": huge_pages,
            "placement": "one arena: the DRAM read covers the pages of every case's weight copies"}


def m_row_calls(lib, one: str, by_m: list[dict], x_all, weights: list, n: int, dev) -> tuple[dict, dict]:
    """For each m > 1 kernel of by_m: a pass over the weight copies ("m{m}"), and whether its rows are bit-identical
    to the m = 1 kernel `one` on each row of x alone (batch invariance)."""
    import numpy as np
    import tvm.runtime
    from helmc.runtime.tvm_tensors import tensor_from_numpy

    def call(name, xm):
        y = tvm.runtime.empty((len(xm), n), "float32", dev)
        lib[name](tensor_from_numpy(np.ascontiguousarray(xm), "float32", dev), weights[0], y)
        return y.numpy()
    singles = [call(one, x_all[t:t + 1])[0] for t in range(len(x_all))]
    calls, equal = {}, {}
    for e in by_m:
        m, fn = e["m"], lib[e["name"]]
        got = call(e["name"], x_all[:m])
        equal[m] = all(np.array_equal(got[t].view(np.uint32), singles[t].view(np.uint32)) for t in range(m))
        x = tensor_from_numpy(np.ascontiguousarray(x_all[:m]), "float32", dev)
        y = tvm.runtime.empty((m, n), "float32", dev)
        calls[f"m{m}"] = lambda fn=fn, x=x, y=y: [fn(x, w, y) for w in weights]
    return calls, equal


def amx_gemm_check(lib, entry: dict, rounds: int, min_bytes: int, arena: WeightArena, prompt: int = 128) -> dict:
    """Each blocking variant of one shape's AMX prefill GEMM against float64 (1 to 200 tokens: token tails,
    a second token chunk) and its time for a `prompt`-token GEMM beside torch's linear in bf16 (the issue's
    reference), both cycling through the same weight copies (>= min_bytes: read from DRAM, as in a prefill)."""
    import numpy as np
    import torch
    import tvm.runtime
    from helmc.runtime.tvm_tensors import tensor_from_numpy
    dev = tvm.runtime.cpu()
    (n, k), dtype = entry["shape"], entry["dtype"]
    rng = np.random.default_rng(n + k)
    weights, w64 = weight_copies(rng, n, k, dtype, min_bytes, arena)
    fns = {v["blocking"]: lib[v["name"]] for v in entry["variants"]}
    errs = {}
    for tokens in (1, 5, 33, prompt, 200):
        x32 = rng.standard_normal((tokens, k), dtype=np.float32)
        ref = x32.astype(np.float64) @ w64.T
        for name, fn in fns.items():
            y = tvm.runtime.empty((tokens, n), "float32", dev)
            fn(tensor_from_numpy(x32, "float32", dev), weights[0], y)
            errs[name] = max(errs.get(name, 0.0), float(np.abs(y.numpy() - ref).max() / np.abs(ref).max()))
    x32 = rng.standard_normal((prompt, k), dtype=np.float32)
    x, y = tensor_from_numpy(x32, "float32", dev), tvm.runtime.empty((prompt, n), "float32", dev)
    torch_weights = [torch.from_dlpack(w) if dtype == "bfloat16" else torch.from_dlpack(w).to(torch.bfloat16)
                     for w in weights]
    xt = torch.from_numpy(x32).to(torch.bfloat16)

    def helmc_pass(fn):
        return lambda: [fn(x, w, y) for w in weights]

    passes = {name: helmc_pass(fn) for name, fn in fns.items()}
    passes["torch_bf16"] = lambda: [torch.nn.functional.linear(xt, w) for w in torch_weights]
    for p in passes.values():
        p()
    times = timed_rounds(passes, rounds)
    per_call = {name: [t / len(weights) for t in ts] for name, ts in times.items()}
    flops = 2.0 * prompt * n * k
    torch_ms = min(per_call["torch_bf16"]) * 1e3
    variants = [{"blocking": name, "rel_err": errs[name], "helmc_ms": round(min(per_call[name]) * 1e3, 3),
                 "helmc_ms_median": round(float(np.median(per_call[name])) * 1e3, 3),
                 "helmc_tflops": round(flops / min(per_call[name]) / 1e12, 2),
                 "speedup_vs_torch_bf16": round(torch_ms / (min(per_call[name]) * 1e3), 3)} for name in fns]
    best = min(variants, key=lambda v: v["helmc_ms"])
    return {"shape": [n, k], "dtype": dtype, "tokens": prompt, "weight_copies": len(weights),
            "rel_err": max(errs.values()), "helmc_ms": variants[0]["helmc_ms"], "best_blocking": best["blocking"],
            "best_ms": best["helmc_ms"], "torch_bf16_ms": round(torch_ms, 3),
            "torch_bf16_ms_median": round(float(np.median(per_call["torch_bf16"])) * 1e3, 3),
            "helmc_tflops": variants[0]["helmc_tflops"], "variants": variants}


def main() -> None:
    ap = experiment_parser(__doc__, 5)      # --build-only, --run-only, --hardware, --features, --rounds
    ap.add_argument("--models", default="4b,8b,14b", help="comma list of 4b, 8b, 14b")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--l3-bytes", type=int, help="size the DRAM read for this L3 (default: this machine's)")
    ap.add_argument("--threads", type=int, default=0, help="default: every core this process may use")
    ap.add_argument("--huge-pages", action="store_true", help="weight copies and DRAM read in MADV_HUGEPAGE memory")
    ap.add_argument("--gemv-prefetch", type=int, default=None,
                    help="build the GEMVs with software prefetch this many K steps ahead, 0 for none "
                         "(default: gemv.PREFETCH_STEPS)")
    ap.add_argument("--amx-variants", default="8b",
                    help="models whose shapes get every AMX GEMM blocking variant (others: the default)")
    ap.add_argument("--types", default=",".join(DTYPES), help="weight types: float16, bfloat16, q8_0, q4_0, q4_k, q6_k")
    ap.add_argument("--m", default="1", help="rows of x (tokens) of the GEMVs, e.g. 1,2,4,8: m > 1 timed against m = 1")
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(threads)  # TVM's default is half the cores on x86
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in QWEN3:
            sys.exit(f"--models: expected names from {sorted(QWEN3)}, found {m!r}")
    if args.run_only:
        report = run(args.run_only, threads, args.rounds, models, args.huge_pages)
    else:
        features, target_l3 = target_features(args)
        out_dir = args.build_only or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"helmc_gemv_bench_{os.getpid()}")
        build(out_dir, features, models, 4 * (args.l3_bytes or target_l3),
              [m.strip().lower() for m in args.amx_variants.split(",") if m.strip() in QWEN3], args.gemv_prefetch,
              tuple(t.strip() for t in args.types.split(",") if t.strip()), tuple(int(m) for m in args.m.split(",")))
        if args.build_only:
            print(f"built {out_dir}: run there with  python -m benchmarks.bench_cpu_gemv --run-only {out_dir}")
            return
        report = run(out_dir, threads, args.rounds, models, args.huge_pages)
    if args.json:
        print(json.dumps(report))
        return
    print(f"DRAM read {report['dram_gbs']:.1f} GB/s over {report['read_bytes'] >> 20} MiB "
          f"(L3 {report['l3_bytes'] >> 20} MiB), {threads} threads, ISA {report['isa']}")
    print(f"{'shape (N x K)':>16} {'dtype':>9} {'helmc GB/s':>11} {'DRAM GB/s':>10} {'% DRAM':>7} {'% best':>7}"
          f" {'torch GB/s':>11} {'rel err':>9} {'pages GB/s':>11} {'% pages':>8}   medians: helmc / torch"
          + ("  (huge pages)" if report["huge_pages"] else ""))
    for r in report["results"]:
        n, k = r["shape"]
        print(f"{n:>7} x {k:<7}{r['dtype']:>9} {r['helmc_gbs']:>11.1f} {r['dram_gbs_case']:>10.1f}"
              f" {100 * r['helmc_over_dram_case']:>6.0f}% {100 * r['helmc_gbs'] / report['dram_gbs']:>6.0f}%"
              f" {r['torch_gbs']:>11.1f} {r['rel_err'] or float('nan'):>9.1e}"
              f" {r.get('pages_read_gbs', float('nan')):>11.1f}"
              f" {100 * r.get('helmc_over_pages_read', float('nan')):>7.0f}%"
              f"   {r['helmc_gbs_median']:.1f} / {r['torch_gbs_median']:.1f}")
        for e in r.get("m_rows", []):
            same = "bit-identical to" if e["rows_equal_m1"] else "DIFFER from"
            print(f"{'':>26} m={e['m']}: {e['gbs']:>6.1f} GB/s (median {e['gbs_median']:.1f}), "
                  f"{e['time_over_m1']:.2f}x the m=1 time, rows {same} m=1")
    print("DRAM GB/s: the read over the same pages in this case's interleaved rounds (% DRAM); % best: of the "
          "run's best read")
    for r in report["amx_gemm"]:
        n, k = r["shape"]
        print(f"AMX GEMM {n} x {k} {r['dtype']}, {r['tokens']} tokens from DRAM: torch bf16 {r['torch_bf16_ms']:.2f} ms; "
              f"rel err vs float64 {r['rel_err']:.1e} (1-200 tokens)")
        for v in r["variants"]:
            print(f"    {v['blocking']:>8}: {v['helmc_ms']:.2f} ms (median {v['helmc_ms_median']:.2f}, "
                  f"{v['helmc_tflops']:.1f} TFLOPS, {v['speedup_vs_torch_bf16']:.2f}x torch)")


if __name__ == "__main__":
    main()
