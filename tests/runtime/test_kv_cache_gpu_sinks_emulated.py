"""KVCacheGPU with attention sinks (gpt-oss: a logit per query head in each softmax's denominator), on the CPU through
tests/kv_device_emulator.py, whose kernels take the sinks as the CUDA kernels' modules say (the split merge adds
them once, the single-launch kernels start from them, flash_prefill starts from them in a launch reading no state).

Every path of the cache against full_attention(..., sinks=) in float64 over the fp16 K/V: a fresh prompt (flash and
prefill_causal), later chunks (tiles; flash over device and staged host pages with the state carried), decode on
the short, fused and split kernels, with pages offloaded and without (bit for bit equal), sliding windows, and the
batched decode launch (bit for bit each sequence alone). The references are recomputed here.
"""
import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv.cache_gpu import KVCacheGPU
from helmc.runtime.kv.paged_attention import full_attention
from kv_device_emulator import EmulatedOps

H_KV, GROUP, D, T = 2, 4, 32, 8
PREFILL_TOL, DECODE_TOL = 1e-5, 2e-3    # decode reads fp16 queries and writes fp16 outputs, as on the GPU


def layer_sinks(layers: int, seed: int = 0) -> tuple:
    """Sink logits of the size of the scores (|q.k| * 0.2 ~ 1 here): they take a visible share of each softmax."""
    rng = np.random.default_rng(100 + seed)
    return tuple((rng.standard_normal(H_KV * GROUP) * 1.5 + 1.0).astype(np.float32) for _ in range(layers))


def make(sinks, layers=2, page_tokens=T, ops=None, **kw):
    return KVCacheGPU(num_layers=layers, num_kv_heads=H_KV, head_dim=D, page_tokens=page_tokens, max_tokens=512,
                      staging_pages=kw.pop("staging_pages", 4), ops=ops or EmulatedOps(num_sms=2), sinks=sinks, **kw)


def drive(caches, steps, seed, sinks, windows=(0, 0), q_dtype=np.float32):
    """Identical rows into every cache; returns (worst prefill error, worst decode error, every decode output bitwise
    equal across caches, the worst gap between the sinks' reference and the one without them)."""
    rng = np.random.default_rng(seed)
    hist = [[np.zeros((0, H_KV, D), np.float16)] * 2 for _ in windows]
    worst, identical, gap = [0.0, 0.0], True, 0.0
    for S in steps:
        for layer, w in enumerate(windows):
            k, v = rng.standard_normal((2, S, H_KV, D)).astype(np.float32)
            q = rng.standard_normal((S, H_KV * GROUP, D)).astype(q_dtype)
            outs = []
            for c in caches:
                c.append(layer, k, v)
                outs.append(c.attend(layer, q, 0.2))
                assert c.pool.staged() == {}, "every staging slot is released after attention"
            hist[layer] = [np.concatenate([hist[layer][0], k.astype(np.float16)]),
                           np.concatenate([hist[layer][1], v.astype(np.float16)])]
            q_ref = q.astype(np.float16) if S == 1 or q_dtype == np.float16 else q
            ref = full_attention(q_ref, *hist[layer], 0.2, window=w, sinks=sinks[layer])
            plain = full_attention(q_ref, *hist[layer], 0.2, window=w)
            gap = max(gap, float(np.abs(ref - plain).max() / np.abs(ref).max()))
            for o in outs:
                assert o.shape == (S, H_KV * GROUP, D) and o.dtype == q_dtype
                err = float(np.abs(o.astype(np.float64) - ref).max() / np.abs(ref).max())
                worst[S == 1] = max(worst[S == 1], err)
            if S == 1:
                identical &= all(np.array_equal(outs[0], o) for o in outs[1:])
        for c in caches:
            c.advance(S)
    return worst[0], worst[1], identical, gap


def test_sinks_prefill_and_decode_with_and_without_offload():
    """Split decode (fused where every page is on the device, partials and the merge where some are on the host):
    within rounding of the float64 reference with sinks, offload equal to no offload bit for bit."""
    sinks = layer_sinks(2)
    off, full = make(sinks, gpu_pages=3, watermark=0.5), make(sinks, offload=False)
    steps = [37] + [1] * 30 + [13] + [1] * 10                  # the second prefill attends over host pages
    pre, dec, identical, gap = drive([off, full], steps, 1, sinks)
    t = off.pool.page_table(off._seq)
    on_host = sum(not t.on_device(i) for i in range(t.n_pages))
    print(f"\nsinks: prefill error {pre:.2e}, decode {dec:.2e}, offload bitwise equal {identical}, {on_host} host "
          f"pages; sinks move the output by {gap:.2e}")
    assert gap > 0.05, "the sinks should matter to this check"
    assert pre < PREFILL_TOL and dec < DECODE_TOL and identical
    assert on_host >= 1 and off.ops.fused_launches < full.ops.fused_launches   # the merge path ran too


def test_sinks_on_the_short_kernel_with_a_staged_page():
    """Up to the short path's page count the decode is paged_decode_short's (slot 0 starts from the sink); a page
    evicted to the host is staged and the same kernel runs: the same bits."""
    sinks = layer_sinks(2, seed=1)
    resident, off = make(sinks, offload=False), make(sinks, gpu_pages=2, watermark=0.5)
    pre, dec, identical, _ = drive([resident, off], [T - 3] + [1] * 8, 2, sinks)
    t = off.pool.page_table(off._seq)
    assert pre < PREFILL_TOL and dec < DECODE_TOL and identical
    assert resident.ops.short_launches == off.ops.short_launches == 2 * 8
    assert any(not t.on_device(i) for i in range(t.n_pages))


@pytest.mark.parametrize("windows", [(11, 11), (11, 0)])
def test_sinks_with_sliding_windows(windows):
    """Sliding windows (one for all layers; Gemma 3-like interleaving, as gpt-oss alternates) with sinks, pages on
    the host and without."""
    sinks = layer_sinks(2, seed=2)
    for kw in ({"gpu_pages": 3, "watermark": 0.5}, {"offload": False}):
        c = make(sinks, sliding_window=windows, **kw)
        pre, dec, _, _ = drive([c], [19] + [1] * 12 + [3, 1], 4, sinks, windows=windows)
        assert pre < PREFILL_TOL and dec < DECODE_TOL, (kw, pre, dec)


@pytest.mark.parametrize("flash", [True, False])
def test_sinks_in_a_fresh_fp16_prompt(flash):
    """A fresh fp16 prompt: flash_prefill where the cubin has it, else prefill_causal, each starting from the sinks."""
    sinks = layer_sinks(2, seed=3)
    c = make(sinks, ops=EmulatedOps(num_sms=2, flash=flash), gpu_pages=3, watermark=0.5)
    pre, dec, _, _ = drive([c], [20, 7, 1, 1], 6, sinks, q_dtype=np.float16)
    assert pre < DECODE_TOL and dec < DECODE_TOL                # fp16 outputs
    assert c.ops.flash_launches == (2 if flash else 0)


@pytest.mark.parametrize("gpu_pages,staging", [(16, 4), (2, 2)])
def test_sinks_in_later_flash_chunks_count_once(gpu_pages, staging):
    """Later chunks on flash_prefill: with host pages staged group by group, the first launch starts from the sinks
    and the later ones carry them in the state: one sink in the denominator, not one per launch."""
    sinks = layer_sinks(2, seed=4)
    c = make(sinks, page_tokens=64, staging_pages=staging, gpu_pages=gpu_pages, watermark=0.5)
    steps = [128, 64, 64, 64, 64, 64]
    pre, _, _, gap = drive([c], steps, 7, sinks, q_dtype=np.float16)
    print(f"\n{gpu_pages} GPU pages, {staging} staging: {c.ops.flash_launches} flash launches, error {pre:.2e}")
    assert pre < DECODE_TOL and gap > DECODE_TOL * 4
    assert c.ops.flash_launches >= 2 * len(steps) + (0 if gpu_pages == 16 else 1)


def test_batched_decode_with_sinks_equals_each_sequence_alone():
    """GpuDecodeBatch's one launch a layer with the layer's sinks for every sequence: each sequence's bits equal its
    own cache's decode and are within rounding of the float64 reference; caches whose sinks differ are not batched."""
    from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
    sinks = layer_sinks(2, seed=5)
    ops = EmulatedOps(num_sms=2)
    prompts = (3, 17, 8)
    batched, alone = [make(sinks, ops=ops) for _ in prompts], [make(sinks, ops=ops) for _ in prompts]
    rng = np.random.default_rng(5)
    hist = []                                                   # per sequence, per layer: [K, V] [n, h_kv, d] fp16
    for n, a, b in zip(prompts, batched, alone):
        kv = rng.standard_normal((2, 2, n, H_KV, D)).astype(np.float32)     # [layer, K|V, n, h_kv, d]
        for layer in range(2):
            q = rng.standard_normal((n, H_KV * GROUP, D)).astype(np.float32)
            for c in (a, b):
                c.append(layer, *kv[layer])
                c.attend(layer, q, 0.2)
        a.advance(n)
        b.advance(n)
        hist.append([list(kv[layer].astype(np.float16)) for layer in range(2)])
    batch = GpuDecodeBatch(H_KV * GROUP, D, lambda t: t, lambda a: a)
    assert GpuDecodeBatch.applies(batched, H_KV * GROUP * D)
    assert not GpuDecodeBatch.applies(batched + [make(layer_sinks(2, seed=6), ops=ops)], H_KV * GROUP * D)
    assert not GpuDecodeBatch.applies(batched + [make(None, ops=ops)], H_KV * GROUP * D)
    S, worst = 4, 0.0
    for _ in range(10):
        for layer in range(2):
            q = rng.standard_normal((S, H_KV * GROUP * D)).astype(np.float16)
            k, v = rng.standard_normal((2, S, H_KV * D)).astype(np.float16)
            got = batch.attend(batched, layer, q, k, v, 0.2)
            assert got is not None and not got[len(prompts):].any()
            for b, c in enumerate(alone):
                c.append(layer, k[b:b + 1], v[b:b + 1])
                want = c.attend(layer, q[b:b + 1], 0.2).reshape(-1)
                assert np.array_equal(got[b].view(np.uint16), want.view(np.uint16)), (layer, b)
                for w, x in enumerate((k, v)):
                    hist[b][layer][w] = np.concatenate([hist[b][layer][w], x[b].reshape(1, H_KV, D)])
                ref = full_attention(q[b].reshape(1, -1, D), *hist[b][layer], 0.2, sinks=sinks[layer])
                worst = max(worst, float(np.abs(got[b].reshape(1, -1, D) - ref).max() / np.abs(ref).max()))
        for c in batched + alone:
            c.advance(1)
    print(f"\nbatched decode with sinks: bits equal each sequence alone; max error {worst:.2e}")
    assert ops.batch_launches == 2 * 10 and worst < DECODE_TOL


def test_sinks_are_checked_and_kept_on_the_device_once():
    sinks = layer_sinks(2)
    c = make(sinks, offload=False)
    first = c.layer_sinks(1, H_KV * GROUP)
    assert first is c.layer_sinks(1, H_KV * GROUP) and np.array_equal(np.asarray(first), sinks[1])
    assert make(None, offload=False).layer_sinks(0, H_KV * GROUP) is None
    with pytest.raises(HelmcError, match="KVCacheGPU: sinks expected 2 finite vectors of a multiple of 2"):
        make((np.zeros(3, np.float32),) * 2)
    with pytest.raises(HelmcError, match="KVCacheGPU: sinks expected 2 finite"):
        make(sinks[:1])
    with pytest.raises(HelmcError, match="2 attention sinks for layer 0 expected one per query head, found 8"):
        make((np.zeros(2, np.float32),) * 2, offload=False).layer_sinks(0, H_KV * GROUP)
