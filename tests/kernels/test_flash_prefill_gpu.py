"""The tensor-core prefill attention (schedules/gpu/flash_prefill.py) on the GPU through the runtime's CudaOps,
against causal softmax attention in float64 over the same fp16 inputs: fresh prompts, a later chunk of a longer
scratch, a sliding window, one row; keys in shuffled KV pages; keys in three launches with the softmax state carried;
with attention sinks (gpt-oss's heads and window), against full_attention(..., sinks=), and over three launches (the
first starts from the sinks, the others carry them in the state: counted once).
Pass: max |o - ref| / max |ref| <= 4e-3 (P is rounded to fp16 before P V) and no NaN left in the output.
tests/kernels/test_flash_prefill_emulated.py runs the same source on the CPU; benchmarks/bench_flash_prefill.py
times it.

The cubins are built on the compiler machine by
    python -m tests.device.build_flash_prefill_cubins .devrt/flash_check
and carried to the GPU machine; the test looks in $HELMC_FLASH_PREFILL_DIR (default .devrt/flash_check). Needs
CuPy, no TVM compiler.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from tests.gpu_prebuilt import cuda_device

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 4e-3


def flash_ops():
    """(cupy, CudaOps over the prebuilt cubins), or a skip naming what is missing."""
    cp = cuda_device()
    from helmc.runtime.kv.cuda_ops import CudaOps
    from tests.device.build_flash_prefill_cubins import cubin_paths
    path = os.environ.get("HELMC_FLASH_PREFILL_DIR", os.path.join(ROOT, ".devrt", "flash_check"))
    cubins = cubin_paths(path)
    if not all(os.path.isfile(c) for c in cubins.values()):
        pytest.skip(f"no flash_prefill cubins at {path}: build them on the compiler machine with "
                    "`python -m tests.device.build_flash_prefill_cubins .devrt/flash_check` and carry .devrt")
    return cp, CudaOps(cubins)


def rel_err(cp, o, ref) -> float:
    assert not bool(cp.isnan(o).any()), "flash_prefill left rows unwritten"
    return float(np.abs(cp.asnumpy(o).astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("h_kv,g,d,cap,n_q,q_pos0,window", [
    (8, 4, 128, 1000, 1000, 0, 0),        # a fresh prompt, Qwen3-8B heads
    (8, 4, 128, 3000, 512, 2400, 0),      # a later chunk of a longer scratch
    (2, 2, 64, 700, 333, 300, 0),
    (4, 1, 128, 900, 900, 0, 128),        # a sliding window
    (8, 4, 128, 64, 1, 0, 0),             # one row
    (8, 2, 256, 900, 900, 0, 0),          # Gemma 3 12B heads: 66 KB of dynamic shared memory a block
    (8, 2, 256, 1200, 400, 800, 512),     # the same, a later chunk through its sliding window
])
def test_flash_prefill_matches_float64(h_kv, g, d, cap, n_q, q_pos0, window):
    from helmc.runtime.kv.paged_attention import attend_blocks, contiguous_blocks, full_attention
    cp, ops = flash_ops()
    rng = np.random.default_rng(0)
    h_a, n_k, scale = h_kv * g, q_pos0 + n_q, 1.0 / math.sqrt(d)
    q = (rng.standard_normal((n_q, h_a, d)) * 2).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, cap, d)).astype(np.float16)
    qg, kvg = cp.asarray(q), cp.asarray(kv)
    o = cp.full((n_q, h_a, d), cp.nan, cp.float16)
    ops.flash_prefill(qg, kvg[0], kvg[1], n_k, q_pos0, h_kv, window, scale, o)
    ref = full_attention(q, *(x.transpose(1, 0, 2)[:n_k] for x in kv), scale, q_pos0, window)
    err = rel_err(cp, o, ref)
    tiles = attend_blocks(cp, qg, q_pos0, contiguous_blocks(kvg[0, :, :n_k], kvg[1, :, :n_k], 0, 4096), h_kv,
                          scale, window, np.float32, 32 << 20)              # what flash replaces, for comparison
    tiles_err = float(np.abs(cp.asnumpy(tiles).astype(np.float64) - ref).max() / np.abs(ref).max())
    print(f"\nflash {err:.2e}, attend_blocks' fp32 tiles {tiles_err:.2e}")
    assert err <= TOLERANCE


def _paged_chunk(rng):
    """A GPU-stage chunk: keys 0..1535 in shuffled pages of 512 (a layer slice each), then the chunk's own 512."""
    h_kv, g, d, T, start, n_q = 8, 4, 128, 512, 1536, 512
    pool = rng.standard_normal((5, 2, h_kv, T, d)).astype(np.float16)
    slots = [3, 0, 4]
    q = rng.standard_normal((n_q, h_kv * g, d)).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, n_q, d)).astype(np.float16)
    keys = [np.concatenate([pool[slots, w].transpose(1, 0, 2, 3).reshape(h_kv, -1, d), kv[w]], axis=1)
            for w in (0, 1)]
    return dict(h_kv=h_kv, d=d, T=T, start=start, n_q=n_q, pool=pool, slots=slots, q=q, kv=kv, keys=keys)


def test_flash_prefill_reads_keys_from_shuffled_pages():
    from helmc.runtime.kv.paged_attention import full_attention
    cp, ops = flash_ops()
    c = _paged_chunk(np.random.default_rng(1))
    h_kv, d, T, start, n_q, q = c["h_kv"], c["d"], c["T"], c["start"], c["n_q"], c["q"]
    scale = 1.0 / math.sqrt(d)
    poolg = cp.asarray(c["pool"])
    ptrs = cp.asarray(np.array([poolg.data.ptr + s * c["pool"][0].nbytes for s in c["slots"]], np.int64))
    o = cp.full(q.shape, cp.nan, cp.float16)
    kvg = cp.asarray(c["kv"])
    ops.flash_prefill(cp.asarray(q), kvg[0], kvg[1], start + n_q, start, h_kv, 0, scale, o, ptrs, T, start)
    ref = full_attention(q, *(x.transpose(1, 0, 2) for x in c["keys"]), scale, start)
    assert rel_err(cp, o, ref) <= TOLERANCE


def test_flash_prefill_carries_its_state_across_launches():
    """The chunk of the paged test with its keys in three launches (positions 0..1023, 1024..1535, then its own)."""
    from helmc.runtime.kv.paged_attention import full_attention
    cp, ops = flash_ops()
    c = _paged_chunk(np.random.default_rng(1))
    h_kv, d, start, n_q, q = c["h_kv"], c["d"], c["start"], c["n_q"], c["q"]
    scale = 1.0 / math.sqrt(d)
    o = cp.full(q.shape, cp.nan, cp.float16)
    state = cp.empty((n_q, q.shape[1], d + 2), cp.float32)
    allk = [cp.asarray(np.ascontiguousarray(k)) for k in c["keys"]]               # [h_kv, start + n_q, d] each
    for i, (a, b) in enumerate(((0, 1024), (1024, start), (start, start + n_q))):
        ka, va = cp.ascontiguousarray(allk[0][:, a:b]), cp.ascontiguousarray(allk[1][:, a:b])
        ops.flash_prefill(cp.asarray(q), ka, va, b - a, start, h_kv, 0, scale, o, k_pos0=a, state=state,
                          state_in=i > 0, state_out=i < 2)
    ref = full_attention(q, *(x.transpose(1, 0, 2) for x in c["keys"]), scale, start)
    assert rel_err(cp, o, ref) <= TOLERANCE


def sink_logits(h_a: int, seed: int = 0) -> np.ndarray:
    """Logits near the larger scores here (q of std 2, scale 1/sqrt(d)): a visible share of each softmax."""
    return (np.random.default_rng(60 + seed).standard_normal(h_a) * 1.5 + 4.0).astype(np.float32)


@pytest.mark.parametrize("h_kv,g,d,cap,n_q,q_pos0,window", [
    (8, 8, 64, 1000, 1000, 0, 0),         # gpt-oss's heads (64 on 8 KV heads of 64), a fresh prompt
    (8, 8, 64, 1200, 400, 800, 128),      # a later chunk through gpt-oss's 128-token window
    (8, 4, 128, 3000, 512, 2400, 0),
])
def test_flash_prefill_with_sinks_matches_float64(h_kv, g, d, cap, n_q, q_pos0, window):
    from helmc.runtime.kv.paged_attention import full_attention
    cp, ops = flash_ops()
    rng = np.random.default_rng(1)
    h_a, n_k, scale = h_kv * g, q_pos0 + n_q, 1.0 / math.sqrt(d)
    q = (rng.standard_normal((n_q, h_a, d)) * 2).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, cap, d)).astype(np.float16)
    sinks = sink_logits(h_a)
    kvg = cp.asarray(kv)
    o = cp.full((n_q, h_a, d), cp.nan, cp.float16)
    ops.flash_prefill(cp.asarray(q), kvg[0], kvg[1], n_k, q_pos0, h_kv, window, scale, o, sinks=cp.asarray(sinks))
    keys = [x.transpose(1, 0, 2)[:n_k] for x in kv]
    ref = full_attention(q, *keys, scale, q_pos0, window, sinks)
    gap = float(np.abs(ref - full_attention(q, *keys, scale, q_pos0, window)).max() / np.abs(ref).max())
    err = rel_err(cp, o, ref)
    print(f"\nflash with sinks h_kv={h_kv} g={g} d={d}: {err:.2e}; the sinks move the output by {gap:.2e}")
    # the sinks move the output by ten times the kernel's own error at least (over 3000 keys their share thins:
    # 1.3e-2 against an error of 3.4e-4 on an H200), so an output without them fails
    assert err <= TOLERANCE and gap > 10 * err


def test_flash_prefill_counts_the_sinks_once_across_launches():
    """The paged test's chunk with its keys in three launches and sinks given to each: only the first (no state in)
    starts from them."""
    from helmc.runtime.kv.paged_attention import full_attention
    cp, ops = flash_ops()
    c = _paged_chunk(np.random.default_rng(2))
    h_kv, d, start, n_q, q = c["h_kv"], c["d"], c["start"], c["n_q"], c["q"]
    scale = 1.0 / math.sqrt(d)
    sinks = sink_logits(q.shape[1], 1)
    o = cp.full(q.shape, cp.nan, cp.float16)
    state = cp.empty((n_q, q.shape[1], d + 2), cp.float32)
    allk = [cp.asarray(np.ascontiguousarray(k)) for k in c["keys"]]               # [h_kv, start + n_q, d] each
    for i, (a, b) in enumerate(((0, 1024), (1024, start), (start, start + n_q))):
        ka, va = cp.ascontiguousarray(allk[0][:, a:b]), cp.ascontiguousarray(allk[1][:, a:b])
        ops.flash_prefill(cp.asarray(q), ka, va, b - a, start, h_kv, 0, scale, o, k_pos0=a, state=state,
                          state_in=i > 0, state_out=i < 2, sinks=cp.asarray(sinks))
    ref = full_attention(q, *(x.transpose(1, 0, 2) for x in c["keys"]), scale, start, sinks=sinks)
    assert rel_err(cp, o, ref) <= TOLERANCE
