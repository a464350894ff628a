#!/usr/bin/env python3
"""Check the tensor-core prefill attention (schedules/gpu/flash_prefill.py) on the GPU machine (issue 16).

  --build DIR [--arch sm_90]   (here: nvcc) the bundle's paged attention cubin (decode kernels + flash_prefill)
      for (head_dim, group) = (128, 4) (Qwen3-8B/14B), (64, 2) and (128, 1), one sub-directory each.
  DIR [--out FILE]   (GPU machine: CuPy, no TVM) through the runtime's CudaOps:
      - error: flash_prefill against causal softmax attention in float64 (fresh prompts, a later chunk of a
        longer scratch, a sliding window), max |o - ref| / max |ref| <= 4e-3 (P is rounded to fp16 before P V);
        prefill_causal and attend_blocks' fp32 tiles (what flash replaces) on the same inputs for comparison;
      - speed (Qwen3-8B heads: 32 query, 8 KV, d 128): a 512-row chunk of the streamed prefill at key offsets
        0, 8K, 16K, 32K - 512 against attend_blocks' tiles on the same scratch, and a fresh 4096-token prompt
        against prefill_causal; TFLOP/s counts 4 * d flops per visible (query head, row, key).
      Exits 1 if any error check fails.

  There (device tool, carry [".devrt/flash_check"]):
    python tests/device/device_flash_prefill_check.py .devrt/flash_check --out $OUT/flash.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

SHAPES = ((128, 4), (64, 2), (128, 1))
TOLERANCE = 4e-3


def build(out_dir: str, arch: str) -> None:
    from helmc.compiler.passes.compile_gpu_stage import compile_paged_attention
    for d, g in SHAPES:
        sub = os.path.join(out_dir, f"d{d}_g{g}")
        os.makedirs(sub, exist_ok=True)
        compile_paged_attention(d, g, arch, sub)
        print(f"built {sub}")


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


def check(dir_: str, out: str | None) -> int:
    import cupy as cp
    from helmc.runtime.kv.cuda_ops import CudaOps
    from helmc.runtime.kv.paged_attention import attend_blocks, contiguous_blocks, full_attention

    cubins = {(d, g): os.path.join(dir_, f"d{d}_g{g}", "paged_attention.cubin") for d, g in SHAPES}
    ops = CudaOps(cubins)
    rng = np.random.default_rng(0)
    rows, failed = [], 0
    # (h_kv, group, d, cap, n_q, q_pos0, window)
    for h_kv, g, d, cap, n_q, q_pos0, window in [(8, 4, 128, 1000, 1000, 0, 0), (8, 4, 128, 3000, 512, 2400, 0),
                                                 (2, 2, 64, 700, 333, 300, 0), (4, 1, 128, 900, 900, 0, 128),
                                                 (8, 4, 128, 64, 1, 0, 0)]:
        h_a, n_k = h_kv * g, q_pos0 + n_q
        q = (rng.standard_normal((n_q, h_a, d)) * 2).astype(np.float16)
        kv = rng.standard_normal((2, h_kv, cap, d)).astype(np.float16)
        scale = 1.0 / math.sqrt(d)
        qg, kvg = cp.asarray(q), cp.asarray(kv)
        o = cp.full((n_q, h_a, d), cp.nan, cp.float16)
        ops.flash_prefill(qg, kvg[0], kvg[1], n_k, q_pos0, h_kv, window, scale, o)
        ref = full_attention(q, *(x.transpose(1, 0, 2)[:n_k] for x in kv), scale, q_pos0, window)
        err = float(np.abs(cp.asnumpy(o).astype(np.float64) - ref).max() / np.abs(ref).max())
        tiles = attend_blocks(cp, qg, q_pos0, contiguous_blocks(kvg[0, :, :n_k], kvg[1, :, :n_k], 0, 4096), h_kv,
                              scale, window, np.float32, 32 << 20)
        err_tiles = float(np.abs(cp.asnumpy(tiles).astype(np.float64) - ref).max() / np.abs(ref).max())
        ok = err <= TOLERANCE and not bool(cp.isnan(o).any())
        failed += not ok
        rows.append(dict(kind="error", h_kv=h_kv, group=g, d=d, n_q=n_q, q_pos0=q_pos0, window=window,
                         flash_err=err, tiles_err=err_tiles, ok=ok))
        print(f"error  h_kv={h_kv} g={g} d={d} n_q={n_q} q_pos0={q_pos0} window={window}: flash {err:.2e} "
              f"tiles {err_tiles:.2e} {'ok' if ok else 'FAIL'}")

    # a GPU-stage chunk: keys 0..1535 in shuffled pages of 512 (a layer slice each), then the chunk's own 512
    h_kv, g, d, T, start, n_q = 8, 4, 128, 512, 1536, 512
    h_a, scale = h_kv * g, 1.0 / math.sqrt(d)
    pool = rng.standard_normal((5, 2, h_kv, T, d)).astype(np.float16)
    slots = [3, 0, 4]
    poolg = cp.asarray(pool)
    ptrs = cp.asarray(np.array([poolg.data.ptr + s_ * pool[0].nbytes for s_ in slots], np.int64))
    q = rng.standard_normal((n_q, h_a, d)).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, n_q, d)).astype(np.float16)
    o = cp.full((n_q, h_a, d), cp.nan, cp.float16)
    kvg = cp.asarray(kv)
    ops.flash_prefill(cp.asarray(q), kvg[0], kvg[1], start + n_q, start, h_kv, 0, scale, o, ptrs, T, start)
    keys = [np.concatenate([pool[slots, w].transpose(1, 0, 2, 3).reshape(h_kv, -1, d), kv[w]], axis=1)
            for w in (0, 1)]
    ref = full_attention(q, *(x.transpose(1, 0, 2) for x in keys), scale, start)
    err = float(np.abs(cp.asnumpy(o).astype(np.float64) - ref).max() / np.abs(ref).max())
    ok = err <= TOLERANCE and not bool(cp.isnan(o).any())
    failed += not ok
    rows.append(dict(kind="error_paged", n_q=n_q, q_pos0=start, page_tokens=T, flash_err=err, ok=ok))
    print(f"error  paged keys 0..{start - 1} in pages of {T}, chunk of {n_q}: flash {err:.2e} {'ok' if ok else 'FAIL'}")

    # the same chunk with its keys in three launches (positions 0..1023, 1024..1535, then its own), state carried
    o3 = cp.full((n_q, h_a, d), cp.nan, cp.float16)
    state = cp.empty((n_q, h_a, d + 2), cp.float32)
    allk = [cp.asarray(np.ascontiguousarray(a_)) for a_ in keys]                   # [h_kv, start + n_q, d] each
    for i, (a_, b_) in enumerate(((0, 1024), (1024, start), (start, start + n_q))):
        ka, va = cp.ascontiguousarray(allk[0][:, a_:b_]), cp.ascontiguousarray(allk[1][:, a_:b_])
        ops.flash_prefill(cp.asarray(q), ka, va, b_ - a_, start, h_kv, 0, scale, o3, k_pos0=a_, state=state,
                          state_in=i > 0, state_out=i < 2)
    err = float(np.abs(cp.asnumpy(o3).astype(np.float64) - ref).max() / np.abs(ref).max())
    ok = err <= TOLERANCE and not bool(cp.isnan(o3).any())
    failed += not ok
    rows.append(dict(kind="error_state", n_q=n_q, q_pos0=start, launches=3, flash_err=err, ok=ok))
    print(f"error  keys in 3 launches, state carried: flash {err:.2e} {'ok' if ok else 'FAIL'}")

    h_kv, g, d, S = 8, 4, 128, 32768
    h_a, scale = h_kv * g, 1.0 / math.sqrt(d)
    kvg = cp.asarray(rng.standard_normal((2, h_kv, S, d)).astype(np.float16))
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
    # the 32K prompt's streamed prefill: 64 chunks of 512 per block
    chunks = [timed(cp, lambda c0=c0: ops.flash_prefill(qg[:512], kvg[0], kvg[1], c0 + 512, c0, h_kv, 0, scale,
                                                        o[:512]), reps=1) for c0 in range(0, S, 512)]
    rows.append(dict(kind="block_32k", flash_ms=float(sum(chunks))))
    print(f"32K prompt, one block's 64 chunks: flash {sum(chunks):.1f} ms")
    if out:
        with open(out, "w") as f:
            json.dump({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, f, indent=1)
    print("FAILED" if failed else "all flash_prefill checks passed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--build", action="store_true", help="build the cubins into DIR (compiler machine)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.build:
        build(a.dir, a.arch)
        return 0
    return check(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
