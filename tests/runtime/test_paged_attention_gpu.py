"""The CUDA decode kernel and KVCacheGPU on a real GPU (CuPy). Skipped without CuPy or a GPU.

Kernel vs the NumPy reference (Algorithm 3, float64 over the same fp16 K/V): 1e-3 relative.
Offload vs --no-kv-offload: decode outputs identical bit for bit, with eviction forced by a tiny
watermark; an evicted page read back from pinned memory equals what was written. References are
recomputed here; nothing to regenerate. Run: pytest -m gpu tests/runtime/test_paged_attention_gpu.py
"""
import pytest

from gpu_kv_checks import check_round_trip, drive, kernel_vs_reference, prebuilt_cuda_ops

pytestmark = pytest.mark.gpu


def _cupy():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:                                     # no driver
        pytest.skip(f"no CUDA device ({type(e).__name__})")
    return cp


@pytest.mark.parametrize("h_kv,group,d,page_tokens,n_tokens,pps", [
    (8, 4, 128, 512, 1000, 1),       # Qwen3-8B heads, last page partly filled
    (8, 4, 128, 512, 4096, 3),       # several pages per split
    (2, 1, 64, 16, 37, 1),
    (4, 8, 128, 32, 100, 2),
    (1, 16, 32, 7, 50, 1),
])
def test_kernel_matches_reference_fp16(h_kv, group, d, page_tokens, n_tokens, pps):
    cp = _cupy()
    err, _ = kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens, pages_per_split=pps)
    print(f"\nkernel h_kv={h_kv} group={group} d={d} T={page_tokens} n={n_tokens}: max relative error {err:.2e}")
    assert err < 1e-3


def test_forced_eviction_gives_identical_decode():
    cp = _cupy()
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
    cp = _cupy()
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    c = KVCacheGPU(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16, max_tokens=256, gpu_pages=3,
                   watermark=0.4, ops=prebuilt_cuda_ops(cp, []))
    assert c.resident_limit == 1
    check_round_trip(c, lambda a: cp.asarray(a), lambda: (c.ops.synchronize_stream(c.copy_stream),
                                                         cp.cuda.Device().synchronize()))
