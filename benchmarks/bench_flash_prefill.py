"""The tensor-core prefill attention (schedules/gpu/flash_prefill.py) timed on the GPU machine, Qwen3-8B heads
(32 query, 8 KV, head_dim 128), against what it replaces.

    python -m benchmarks.bench_flash_prefill CUBIN_DIR [--out FILE.json]

CUBIN_DIR from `python -m tests.device.build_flash_prefill_cubins CUBIN_DIR` (compiler machine, nvcc); needs CuPy,
no TVM compiler. Correctness is pytest's: `pytest -m gpu tests/kernels/test_flash_prefill_gpu.py`.
  - a 512-row chunk of the streamed prefill at key offsets 0, 8K, 16K, 32K - 512 against attend_blocks' fp32 tiles
    on the same scratch;
  - a fresh 4096-token prompt against prefill_causal;
  - a 32K prompt's streamed prefill: one block's 64 chunks of 512.
TFLOP/s counts 4 * d flops per visible (query head, row, key). Times: CUDA events, median of 5 (3 for the slower
kernels) after one warm-up call.
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np


def timed(cp, fn, reps: int = 5) -> float:
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(ts))


def visible_pairs(n_q: int, q_pos0: int, n_k: int, window: int) -> int:
    p = q_pos0 + np.arange(n_q)
    lo = np.maximum(0, p - window + 1) if window else np.zeros_like(p)
    return int((np.minimum(p, n_k - 1) - lo + 1).sum())


def measure(cp, ops) -> list[dict]:
    from helmc.runtime.kv.paged_attention import attend_blocks, contiguous_blocks
    rng = np.random.default_rng(0)
    h_kv, g, d, S = 8, 4, 128, 32768
    h_a, scale = h_kv * g, 1.0 / math.sqrt(d)
    kvg = cp.asarray(rng.standard_normal((2, h_kv, S, d)).astype(np.float16))
    rows = []
    for q_pos0 in (0, 8192, 16384, S - 512):
        n_q, n_k = 512, q_pos0 + 512
        qg = cp.asarray((rng.standard_normal((n_q, h_a, d))).astype(np.float16))
        o = cp.empty((n_q, h_a, d), cp.float16)
        t_flash = timed(cp, lambda: ops.flash_prefill(qg, kvg[0], kvg[1], n_k, q_pos0, h_kv, 0, scale, o))
        t_tiles = timed(cp, lambda: attend_blocks(cp, qg, q_pos0, contiguous_blocks(
            kvg[0, :, :n_k], kvg[1, :, :n_k], 0, 4096), h_kv, scale, 0, np.float32, 32 << 20), reps=3)
        flops = 4.0 * d * h_a * visible_pairs(n_q, q_pos0, n_k, 0)
        rows.append(dict(kind="chunk", n_q=n_q, q_pos0=q_pos0, flash_ms=t_flash, tiles_ms=t_tiles,
                         flash_tflops=flops / t_flash / 1e9, speedup=t_tiles / t_flash))
        print(f"chunk  512 rows at {q_pos0:>5}: flash {t_flash:8.3f} ms ({flops / t_flash / 1e9:6.1f} TFLOP/s), "
              f"tiles {t_tiles:8.3f} ms, {t_tiles / t_flash:5.1f}x")
    n = 4096
    qg = cp.asarray(rng.standard_normal((n, h_a, d)).astype(np.float16))
    kvc = cp.ascontiguousarray(kvg[:, :, :n])
    o = cp.empty((n, h_a, d), cp.float16)
    t_flash = timed(cp, lambda: ops.flash_prefill(qg, kvc[0], kvc[1], n, 0, h_kv, 0, scale, o))
    t_causal = timed(cp, lambda: ops.prefill_causal(qg, kvc, h_kv, d, 0, scale, o), reps=3)
    flops = 4.0 * d * h_a * visible_pairs(n, 0, n, 0)
    rows.append(dict(kind="fresh", n=n, flash_ms=t_flash, prefill_causal_ms=t_causal,
                     flash_tflops=flops / t_flash / 1e9, speedup=t_causal / t_flash))
    print(f"fresh  {n} tokens: flash {t_flash:.3f} ms ({flops / t_flash / 1e9:.1f} TFLOP/s), prefill_causal "
          f"{t_causal:.3f} ms, {t_causal / t_flash:.1f}x")
    chunks = [timed(cp, lambda c0=c0: ops.flash_prefill(qg[:512], kvg[0], kvg[1], c0 + 512, c0, h_kv, 0, scale,
                                                        o[:512]), reps=1) for c0 in range(0, S, 512)]
    rows.append(dict(kind="block_32k", flash_ms=float(sum(chunks))))
    print(f"32K prompt, one block's 64 chunks: flash {sum(chunks):.1f} ms")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the cubins from tests.device.build_flash_prefill_cubins")
    ap.add_argument("--out")
    a = ap.parse_args()
    import cupy as cp

    from helmc.runtime.kv.cuda_ops import CudaOps
    from tests.device.build_flash_prefill_cubins import cubin_paths
    rows = measure(cp, CudaOps(cubin_paths(a.dir)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
