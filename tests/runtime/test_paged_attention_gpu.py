"""The CUDA decode kernel and KVCacheGPU on a real GPU (CuPy). Skipped without CuPy or a GPU.

Kernel vs the NumPy reference (Algorithm 3, float64 over the same fp16 K/V): 1e-3 relative.
Offload vs --no-kv-offload: decode outputs identical bit for bit, with eviction forced by a tiny
watermark; an evicted page read back from pinned memory equals what was written. References are
recomputed here; nothing to regenerate. Batched decode (GpuDecodeBatch, one launch for several caches) equals
each cache's own decode bit for bit. Attention sinks (gpt-oss): the kernels with `sinks` against
full_attention(..., sinks=) in float64, the fused decode equal to the merge bit for bit, KVCacheGPU(sinks=) with
offload equal to without, and the batched launch with one layer's sinks for all sequences equal to each alone.
Run: pytest -m gpu tests/runtime/test_paged_attention_gpu.py
"""
import numpy as np
import pytest

from gpu_kv_checks import check_round_trip, drive, kernel_vs_reference, prebuilt_cuda_ops, short_kernel_vs_reference
from tests.gpu_prebuilt import cuda_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("h_kv,group,d,page_tokens,n_tokens,pps", [
    (8, 4, 128, 512, 1000, 1),       # Qwen3-8B heads, last page partly filled
    (8, 4, 128, 512, 4096, 3),       # several pages per split
    (2, 1, 64, 16, 37, 1),
    (4, 8, 128, 32, 100, 2),
    (1, 16, 32, 7, 50, 1),
])
def test_kernel_matches_reference_fp16(h_kv, group, d, page_tokens, n_tokens, pps):
    cp = cuda_device()
    err, _ = kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens, pages_per_split=pps)
    print(f"\nkernel h_kv={h_kv} group={group} d={d} T={page_tokens} n={n_tokens}: max relative error {err:.2e}")
    assert err < 1e-3


@pytest.mark.parametrize("h_kv,group,d,page_tokens,n_tokens", [
    (8, 4, 128, 512, 190), (8, 4, 128, 512, 1000), (8, 4, 128, 512, 1), (2, 8, 64, 16, 100), (4, 2, 32, 32, 77),
])
def test_short_kernel_matches_reference(h_kv, group, d, page_tokens, n_tokens):
    """paged_decode_short_append (schedules/gpu/paged_decode_short.py): within fp16 rounding of Algorithm 3, the
    step's row written into its page."""
    cp = cuda_device()
    err, written = short_kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens)
    print(f"\nshort kernel h_kv={h_kv} group={group} d={d} T={page_tokens} n={n_tokens}: max relative error "
          f"{err:.2e}, row written {written}")
    assert err < 1e-3 and written


def sink_logits(h_a: int, seed: int = 0) -> np.ndarray:
    """Logits near the larger scores of these checks (fp16 q of std 1-2, scale 1/sqrt(d)): a visible share."""
    return (np.random.default_rng(50 + seed).standard_normal(h_a) * 1.5 + 3.0).astype(np.float32)


@pytest.mark.parametrize("h_kv,group,d,page_tokens,n_tokens,pps", [
    (8, 4, 128, 512, 1000, 1), (8, 8, 64, 16, 300, 2),     # gpt-oss's heads: 64 query heads on 8 KV heads of 64
])
def test_split_kernels_with_sinks_match_reference(h_kv, group, d, page_tokens, n_tokens, pps):
    """paged_decode_partial + paged_decode_merge with the sinks (added once, in the merge), and paged_decode_fused
    with them giving the merge's bits."""
    cp = cuda_device()
    err, _ = kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens, pages_per_split=pps,
                                 sinks=sink_logits(h_kv * group))
    print(f"\nsplit kernels with sinks h_kv={h_kv} group={group} d={d}: max relative error {err:.2e}")
    assert err < 1e-3


@pytest.mark.parametrize("h_kv,group,d,page_tokens,n_tokens", [(8, 4, 128, 512, 190), (8, 8, 64, 16, 1),
                                                               (8, 8, 64, 16, 100)])
def test_short_kernel_with_sinks_matches_reference(h_kv, group, d, page_tokens, n_tokens):
    """paged_decode_short_append with the sinks (slot 0 starts from them)."""
    cp = cuda_device()
    err, written = short_kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens, sinks=sink_logits(h_kv * group))
    print(f"\nshort kernel with sinks h_kv={h_kv} group={group} d={d} n={n_tokens}: max relative error {err:.2e}")
    assert err < 1e-3 and written


@pytest.mark.parametrize("page_tokens,max_tokens,steps", [
    (64, 2048, [700] + [1] * 40 + [150] + [1] * 10),      # split kernels, the host pages' splits merged apart
    (64, 1024, [300] + [1] * 60 + [100] + [1] * 20),      # short kernel with staged pages, then splits
])
def test_sinks_offload_gives_identical_decode(page_tokens, max_tokens, steps):
    """KVCacheGPU(sinks=) in gpt-oss's head shape: prefill (flash) and decode within fp16 rounding of full softmax
    with the sinks, decode with pages on the host equal to decode with every page on the GPU bit for bit."""
    cp = cuda_device()
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    sinks = tuple(sink_logits(64, seed) for seed in range(3))
    kw = dict(num_layers=3, num_kv_heads=8, head_dim=64, page_tokens=page_tokens, max_tokens=max_tokens, sinks=sinks)
    ops = prebuilt_cuda_ops(cp, [(64, 8)])
    off = KVCacheGPU(**kw, gpu_pages=4, watermark=0.01, ops=ops)
    full = KVCacheGPU(**kw, offload=False, ops=ops)
    worst, identical = drive(cp, [off, full], steps, 3, 8, 8, 64, sinks=sinks)
    t = off.pool.page_table(off._seq)
    on_host = sum(not t.on_device(i) for i in range(t.n_pages))
    print(f"\nGPU KV with sinks: {t.n_pages} pages, {on_host} on the host; max relative error {worst:.2e}; "
          f"offload == no offload bit for bit: {identical}")
    assert on_host >= 1 and identical and worst < 1e-2


def test_short_contexts_offload_gives_identical_decode():
    """Up to decode_splits.short_path's page count (here 8 pages of 64: half the staging slots), evicted pages are
    staged and the step still runs the short kernel: the same bits as with every page on the GPU."""
    cp = cuda_device()
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    kw = dict(num_layers=3, num_kv_heads=8, head_dim=128, page_tokens=64, max_tokens=1024)
    ops = prebuilt_cuda_ops(cp, [(128, 4)])
    off = KVCacheGPU(**kw, gpu_pages=4, watermark=0.01, ops=ops)
    full = KVCacheGPU(**kw, offload=False, ops=ops)
    worst, identical = drive(cp, [off, full], [300] + [1] * 60 + [100] + [1] * 20, 1, 8, 4, 128)
    t = off.pool.page_table(off._seq)
    on_host = sum(not t.on_device(i) for i in range(t.n_pages))
    print(f"\nshort-context GPU KV: {t.n_pages} pages, {on_host} on the host; max relative error {worst:.2e}; "
          f"offload == no offload bit for bit: {identical}")
    assert t.n_pages <= 8 and on_host >= 1 and identical and worst < 1e-2


def test_forced_eviction_gives_identical_decode():
    cp = cuda_device()
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    kw = dict(num_layers=3, num_kv_heads=8, head_dim=128, page_tokens=64, max_tokens=2048)
    ops = prebuilt_cuda_ops(cp, [(128, 4)])
    off = KVCacheGPU(**kw, gpu_pages=4, watermark=0.01, ops=ops)   # one page resident, the rest on the host
    full = KVCacheGPU(**kw, offload=False, ops=ops)
    worst, identical = drive(cp, [off, full], [700] + [1] * 40 + [150] + [1] * 10, 0, 8, 4, 128)
    t = off.pool.page_table(off._seq)
    on_host = sum(not t.on_device(i) for i in range(t.n_pages))
    print(f"\nGPU KV: {t.n_pages} pages, {on_host} on the host; max relative error (fp16) {worst:.2e}; "
          f"decode offload == no offload bit for bit: {identical}")
    assert on_host >= t.n_pages - 2
    assert identical
    assert worst < 1e-2                                       # fp16 output rounding


def test_evicted_page_round_trip():
    """Pages evicted by the watermark (steps 2-4) and one written straight to the host by a long
    append (step 4) hold exactly the rows appended, in the page layout [L, 2, h_kv, T, d]."""
    cp = cuda_device()
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    c = KVCacheGPU(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16, max_tokens=256, gpu_pages=3,
                   watermark=0.4, ops=prebuilt_cuda_ops(cp, []))
    assert c.resident_limit == 1
    check_round_trip(c, lambda a: cp.asarray(a), lambda: (c.ops.synchronize_stream(c.copy_stream),
                                                         cp.cuda.Device().synchronize()))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_batched_decode_launch_equals_each_sequence_alone(with_sinks):
    """GpuDecodeBatch (a batched decode step of several sequences, each on its own KVCacheGPU: one
    paged_decode_fused_append_batch launch a layer) against twin caches' own append + attend, step by step over a
    page boundary: every sequence's output equal bit for bit, padding rows zero, and the same pages afterwards.
    Sequences from one token (a quarter-page split) to 1500 (whole-page splits) share the launch; with sinks, one
    layer's for every sequence (gpt-oss's heads)."""
    cp = cuda_device()
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
    h_kv, group, d, T = (8, 8, 64, 64) if with_sinks else (8, 4, 128, 64)
    ops = prebuilt_cuda_ops(cp, [(d, group)])
    assert ops.has_fused_append_batch(d, group)
    sinks = tuple(sink_logits(h_kv * group, seed) for seed in range(3)) if with_sinks else None
    kw = dict(num_layers=3, num_kv_heads=h_kv, head_dim=d, page_tokens=T, max_tokens=2048, ops=ops, sinks=sinks)
    prompts = (1, 37, 200, 700, 1500)
    batched, alone = [KVCacheGPU(**kw) for _ in prompts], [KVCacheGPU(**kw) for _ in prompts]
    rng = np.random.default_rng(7)
    for n, a, b in zip(prompts, batched, alone):
        for layer in range(3):
            k, v = cp.asarray(rng.standard_normal((2, n, h_kv, d)).astype(np.float16))
            q = cp.asarray(rng.standard_normal((n, h_kv * group, d)).astype(np.float16))
            for c in (a, b):
                c.append(layer, k, v)
                c.attend(layer, q, 0.1)
        a.advance(n)
        b.advance(n)
    batch = GpuDecodeBatch(h_kv * group, d, lambda t: t, lambda a: a)
    assert GpuDecodeBatch.applies(batched, h_kv * group * d)
    S = 8                                                    # three padding rows
    for step in range(30):                                   # 37 + 30 crosses page 1 -> 2
        for layer in range(3):
            q = cp.asarray(rng.standard_normal((S, h_kv * group * d)).astype(np.float16))
            k, v = cp.asarray(rng.standard_normal((2, S, h_kv * d)).astype(np.float16))
            got = batch.attend(batched, layer, q, k, v, 0.1)
            assert got is not None
            got = cp.asnumpy(got)
            assert not got[len(prompts):].any()
            for b, c in enumerate(alone):
                c.append(layer, k[b:b + 1], v[b:b + 1])
                want = cp.asnumpy(c.attend(layer, q[b:b + 1], 0.1)).reshape(-1)
                assert np.array_equal(got[b].view(np.uint16), want.view(np.uint16)), (step, layer, b)
        for c in batched + alone:
            c.advance(1)
    for a, b in zip(batched, alone):                         # the written rows (the rest of a pool is cp.empty's)
        assert a.length == b.length
        ta, tb = a.pool.page_table(a._seq), b.pool.page_table(b._seq)
        for i in range(ta.n_pages):
            rows = min(T, a.length - i * T)
            pa, pb = a.gpu_store[ta.gpu_slots[i], :, :, :, :rows], b.gpu_store[tb.gpu_slots[i], :, :, :, :rows]
            assert cp.array_equal(pa.view(cp.uint16), pb.view(cp.uint16)), i
    print(f"\nbatched decode launch: {len(prompts)} sequences x 30 steps x 3 layers, every output bit-identical to "
          f"its own cache's append + attend")
