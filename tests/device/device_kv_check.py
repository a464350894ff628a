"""GPU-machine check of the paged KV cache: correctness, then timings, as one short table.

Run from the repository root on the GPU machine (CuPy present):
    PYTHONPATH=. python tests/device/device_kv_check.py [--gpu-layers 15] [--cpu-layers 4] \
        [--contexts 1024,8192,32768] [--kv-vram-gib 0.45] [--steps 16] [--json $OUT/kv_check.json]

1. pytest -m gpu tests/runtime/test_paged_attention_gpu.py (kernel vs NumPy to 1e-3 in fp16; forced eviction
   gives bit-identical decode; evicted pages round-trip through pinned memory).
2. Kernel max relative error at Qwen3-8B shapes (8 KV heads, 32 query heads, head_dim 128, fp16).
3. Kernel time per layer (all pages resident, CUDA events) at each context.
4. A decode step of `--gpu-layers` layers through KVCacheGPU (append 1 row + attend per layer, then
   advance) with all KV on the GPU and with only `--kv-vram-gib` of VRAM for pages (the rest
   streamed from pinned host memory): wall ms per step and PCIe bytes per step.
5. CPU-layer decode attention (KVCacheCPU) per layer: fp32 KV on 1 thread and on all cores, fp16 KV
   on all cores (NumPy converts fp16 pages to fp32 before each matmul).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

H_KV, H_A, D, T = 8, 32, 128, 512


def run_pytest() -> str:
    try:
        import pytest  # noqa: F401  (only to know whether the GPU tests can run here)
    except ImportError:
        return "pytest not installed here; the same checks run below"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-s", "tests/runtime/test_paged_attention_gpu.py"],
                       cwd=ROOT, capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    print("\n".join(lines[-25:]))
    return lines[-1] if lines else f"pytest rc={r.returncode}"


def kernel_error(cp, n_tokens: int) -> float:
    from gpu_kv_checks import kernel_vs_reference
    return kernel_vs_reference(cp, H_KV, H_A // H_KV, D, T, n_tokens)[0]


def offload_identical(cp) -> tuple[bool, float, bool]:
    """Forced eviction (one resident page) vs everything on the GPU: 4 layers, a 3000-token prompt,
    32 decode steps. Returns (decode bitwise equal, max relative error vs full softmax, round trip ok)."""
    from gpu_kv_checks import check_round_trip, drive, prebuilt_cuda_ops
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    ops = prebuilt_cuda_ops(cp, [(D, H_A // H_KV)])
    kw = dict(num_layers=4, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=4096, ops=ops)
    off, full = KVCacheGPU(**kw, gpu_pages=3, watermark=0.01), KVCacheGPU(**kw, offload=False)
    worst, identical = drive(cp, [off, full], [3000] + [1] * 32, 0, H_KV, H_A // H_KV, D)
    c = KVCacheGPU(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16, max_tokens=256, gpu_pages=3,
                   watermark=0.4, ops=ops)
    try:
        check_round_trip(c, cp.asarray, lambda: (c.ops.synchronize_stream(c.copy_stream), cp.cuda.Device().synchronize()))
        round_trip = True
    except AssertionError:
        round_trip = False
    return identical, worst, round_trip


def kernel_time_us(cp, n_tokens: int, reps: int = 50) -> float:
    from gpu_kv_checks import prebuilt_cuda_ops
    ops = prebuilt_cuda_ops(cp, [(D, H_A // H_KV)])
    n_pages = -(-n_tokens // T)
    pool = cp.random.standard_normal((n_pages, 2, H_KV, T, D), dtype=cp.float32).astype(cp.float16)
    ptrs = cp.asarray(np.array([pool.data.ptr + i * pool[0].nbytes for i in range(n_pages)], np.int64))
    p = max(1, -(-n_pages // max(1, 4 * ops.num_sms // H_KV)))
    n_splits = -(-n_pages // p)
    pm, ps = cp.empty(n_splits * H_A, cp.float32), cp.empty(n_splits * H_A, cp.float32)
    po = cp.empty(n_splits * H_A * D, cp.float32)
    q = cp.random.standard_normal((H_A, D), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((H_A, D), cp.float16)
    step_dev = cp.asarray(np.array([n_tokens, 0], np.int32))

    def step():
        ops.decode_partial(q, ptrs, T, step_dev, p * T, 0, n_splits, H_KV, D, 0.088, pm, ps, po)
        ops.decode_merge(pm, ps, po, 0, n_splits, H_A, D, H_A // H_KV, out)
    for _ in range(3):
        step()
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    t0.record()
    for _ in range(reps):
        step()
    t1.record()
    t1.synchronize()
    return cp.cuda.get_elapsed_time(t0, t1) * 1000 / reps


def fill(cache, n_tokens: int, xp, chunk: int = 4096) -> None:
    rng = np.random.default_rng(0)
    block = rng.standard_normal((2, chunk, H_KV, D)).astype(np.float16)
    dev = xp.asarray(block)
    done = 0
    while done < n_tokens:
        S = min(chunk, n_tokens - done)
        for layer in range(cache.L if hasattr(cache, "L") else cache.num_layers):
            cache.append(layer, dev[0, :S], dev[1, :S])
        cache.advance(S)
        done += S


def decode_step_ms(cp, layers: int, n_tokens: int, steps: int, vram_bytes: int | None) -> dict:
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    offload = vram_bytes is not None
    from gpu_kv_checks import prebuilt_cuda_ops
    cache = KVCacheGPU(layers, H_KV, D, T, n_tokens + steps + 8, offload=offload, vram_bytes=vram_bytes,
                       ops=prebuilt_cuda_ops(cp, [(D, H_A // H_KV)]))
    fill(cache, n_tokens, cp)
    k = cp.random.standard_normal((1, H_KV, D), dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((1, H_A, D), dtype=cp.float32).astype(cp.float16)
    times = []
    for i in range(steps + 2):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for layer in range(layers):
            cache.append(layer, k, k)
            cache.attend(layer, q, 0.088)
        cache.advance(1)
        cp.cuda.Device().synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1000)
    table = cache.pool.page_table(cache._seq)
    host = sum(not table.on_device(i) for i in range(table.n_pages))
    pcie = host * layers * cache.slice_elems * 2
    ms = float(np.median(times))
    del cache
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    return {"ms": ms, "host_pages": host, "pcie_mb": pcie / 1e6, "pcie_gbs": pcie / 1e6 / ms if host else 0.0}


def cpu_attend_ms(n_tokens: int, layers: int, threads: int, reps: int = 5, dtype=np.float32) -> float:
    from helmc.runtime.kv.cache_cpu import KVCacheCPU
    cache = KVCacheCPU(layers, H_KV, D, T, n_tokens + reps + 4, dtype, threads=threads)
    fill(cache, n_tokens, np)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, H_KV, D)).astype(np.float32)
    q = rng.standard_normal((1, H_A, D)).astype(np.float32)
    times = []
    for _ in range(reps):
        for layer in range(layers):
            cache.append(layer, k, k)
            t = time.perf_counter()
            cache.attend(layer, q, 0.088)
            times.append((time.perf_counter() - t) * 1000)
        cache.advance(1)
    cache.close()
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-layers", type=int, default=15)
    ap.add_argument("--cpu-layers", type=int, default=4, help="layers cycled for the CPU timing (beats the L3)")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--kv-vram-gib", type=float, default=0.45, help="VRAM for GPU KV pages in the offload run")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", default="")
    ap.add_argument("--skip-pytest", action="store_true")
    args = ap.parse_args()
    import cupy as cp
    from helmc.runtime.kv.cache_cpu import default_threads

    report = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "gpu_layers": args.gpu_layers}
    report["pytest"] = "skipped" if args.skip_pytest else run_pytest()
    report["kernel_rel_err"] = {n: kernel_error(cp, n) for n in (1000, 8192, 32768)}
    identical, worst, round_trip = offload_identical(cp)
    report.update(offload_bit_identical=identical, offload_rel_err=worst, evicted_page_round_trip=round_trip)
    rows = []
    for n in (int(x) for x in args.contexts.split(",")):
        row = {"context": n, "kernel_us_per_layer": kernel_time_us(cp, n)}
        row["resident"] = decode_step_ms(cp, args.gpu_layers, n, args.steps, None)
        row["offload"] = decode_step_ms(cp, args.gpu_layers, n, args.steps, int(args.kv_vram_gib * 2**30))
        row["cpu_ms_per_layer_1t"] = cpu_attend_ms(n, args.cpu_layers, 1)
        row["cpu_ms_per_layer_mt"] = cpu_attend_ms(n, args.cpu_layers, default_threads())
        row["cpu_fp16_ms_per_layer_mt"] = cpu_attend_ms(n, args.cpu_layers, default_threads(), dtype=np.float16)
        rows.append(row)
    report["rows"] = rows
    print(f"\ndevice: {report['device']}   pytest: {report['pytest']}")
    print("kernel max relative error (fp16, Qwen3-8B heads): "
          + ", ".join(f"n={n}: {e:.2e}" for n, e in report["kernel_rel_err"].items()))
    print(f"decode with forced eviction == without offload, bit for bit: {identical} "
          f"(max relative error vs full softmax {worst:.2e}); evicted pages round-trip: {round_trip}")
    print(f"\n{'context':>8} {'kernel us/layer':>16} {'step ms (all on GPU)':>21} {'step ms (offload)':>18} "
          f"{'host pages':>10} {'PCIe MB/step':>12} {'CPU ms/layer 1t':>16} {f'CPU ms/layer {default_threads()}t':>16} "
          f"{'CPU fp16 KV ms/layer':>20}")
    for r in rows:
        print(f"{r['context']:>8} {r['kernel_us_per_layer']:>16.1f} {r['resident']['ms']:>21.2f} "
              f"{r['offload']['ms']:>18.2f} {r['offload']['host_pages']:>10} {r['offload']['pcie_mb']:>12.1f} "
              f"{r['cpu_ms_per_layer_1t']:>16.2f} {r['cpu_ms_per_layer_mt']:>16.2f} {r['cpu_fp16_ms_per_layer_mt']:>20.2f}")
    print(f"(step = {args.gpu_layers} GPU layers x (append 1 row + attend) + advance; offload keeps "
          f"{args.kv_vram_gib} GiB of pages on the GPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
