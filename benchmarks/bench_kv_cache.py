"""The paged KV cache's decode attention on the GPU machine: kernel time, a decode step with and without KV
offload, and the CPU cache's attention, as one short table.

    python -m benchmarks.bench_kv_cache [--gpu-layers 15] [--cpu-layers 4] [--contexts 1024,8192,32768] \
        [--kv-vram-gib 0.45] [--steps 16] [--json FILE.json]

Needs CuPy and nvcc (the kernels are compiled here for this GPU, as tests/gpu_kv_checks.py does). Correctness is
pytest's: `pytest -m gpu tests/runtime/test_paged_attention_gpu.py` (kernel against NumPy at Qwen3-8B heads, forced
eviction bit-identical to all-resident decode, evicted pages round-tripping through pinned memory).

1. Kernel time per layer (all pages resident, CUDA events) at each context, Qwen3-8B shapes (8 KV heads, 32 query
   heads, head_dim 128, fp16).
2. A decode step of `--gpu-layers` layers through KVCacheGPU (append 1 row + attend per layer, then advance) with
   all KV on the GPU and with only `--kv-vram-gib` of VRAM for pages (the rest streamed from pinned host memory):
   wall ms per step and PCIe bytes per step.
3. CPU-layer decode attention (KVCacheCPU) per layer: fp32 KV on 1 thread and on all cores, fp16 KV on all cores
   (NumPy converts fp16 pages to fp32 before each matmul).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

H_KV, H_A, D, T = 8, 32, 128, 512


def kernel_time_us(cp, n_tokens: int, reps: int = 50) -> float:
    from tests.gpu_kv_checks import prebuilt_cuda_ops
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
    from tests.gpu_kv_checks import prebuilt_cuda_ops
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
    args = ap.parse_args()
    import cupy as cp
    from helmc.runtime.kv.cache_cpu import default_threads

    report = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "gpu_layers": args.gpu_layers}
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
    print(f"\ndevice: {report['device']}")
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
