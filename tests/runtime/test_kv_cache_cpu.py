"""KV cache of the CPU-stage layers (runtime/kv/cache_cpu.py): a prefill then decode steps, every
attention output compared with full softmax (float64) over everything appended so far. The
reference is recomputed in the test; nothing to regenerate. Each test prints its max error."""
import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv.cache_cpu import KVCacheCPU, _split_by_tokens
from helmc.runtime.kv.paged_attention import full_attention


def run_steps(cache, rng, steps, h_kv, h_a, d, kv_dtype=np.float32, window=0, hist=None, sinks=None):
    """Drive the cache like a stage does; return the worst relative error against full attention. `hist`: the
    keys and values appended by earlier calls on the same cache ([], filled here, to continue with)."""
    L = cache.num_layers
    if hist is not None and not hist:
        hist += [[np.zeros((0, h_kv, d)) for _ in range(L)], [np.zeros((0, h_kv, d)) for _ in range(L)]]
    hist_k, hist_v = hist or ([np.zeros((0, h_kv, d)) for _ in range(L)], [np.zeros((0, h_kv, d)) for _ in range(L)])
    worst = 0.0
    for S in steps:
        for layer in range(L):
            k = rng.standard_normal((S, h_kv, d)).astype(np.float32)
            v = rng.standard_normal((S, h_kv, d)).astype(np.float32)
            q = rng.standard_normal((S, h_a, d)).astype(np.float32)
            cache.append(layer, k, v)
            o = cache.attend(layer, q, 0.3)
            hist_k[layer] = np.concatenate([hist_k[layer], k.astype(kv_dtype)])
            hist_v[layer] = np.concatenate([hist_v[layer], v.astype(kv_dtype)])
            w = window[layer] if isinstance(window, tuple) else window
            ref = full_attention(q, hist_k[layer], hist_v[layer], 0.3, window=w,
                                 sinks=None if sinks is None else sinks[layer])
            assert o.shape == (S, h_a, d) and o.dtype == np.float32 and np.isfinite(o).all()
            worst = max(worst, float(np.abs(o - ref).max() / np.abs(ref).max()))
        cache.advance(S)
    return worst


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_then_decode_matches_full_attention(group):
    rng = np.random.default_rng(group)
    h_kv, d = 2, 16
    cache = KVCacheCPU(num_layers=2, num_kv_heads=h_kv, head_dim=d, page_tokens=8, max_tokens=80,
                       block_tokens=16, score_budget_bytes=4096)
    worst = run_steps(cache, rng, [37] + [1] * 12 + [5, 1], h_kv, h_kv * group, d)
    print(f"\nCPU KV, GQA {group}: max relative error vs full softmax over 15 steps = {worst:.2e}")
    assert worst < 1e-5
    assert cache.length == 55
    assert cache.kind_pages(0).table(0).host_slots == tuple(range(7))


def test_sliding_window_fp16_storage_and_reset():
    rng = np.random.default_rng(7)
    cache = KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=32, page_tokens=4, max_tokens=64,
                       dtype=np.float16, sliding_window=6)
    worst = run_steps(cache, rng, [11, 1, 1, 1, 9, 1], 1, 2, 32, kv_dtype=np.float16, window=6)
    print(f"\nCPU KV, fp16 storage, window 6: max relative error = {worst:.2e}")
    assert worst < 1e-5
    cache.reset()
    assert cache.length == 0
    worst = run_steps(cache, np.random.default_rng(8), [3, 1], 1, 2, 32, kv_dtype=np.float16, window=6)
    assert worst < 1e-5


def test_per_layer_windows():
    """Gemma 3's interleaving: each layer its own window (0: the whole context), prefill and decode past them."""
    cache = KVCacheCPU(num_layers=3, num_kv_heads=1, head_dim=16, page_tokens=4, max_tokens=64,
                       sliding_window=(6, 0, 3))
    worst = run_steps(cache, np.random.default_rng(3), [11, 1, 1, 7, 1, 1], 1, 2, 16, window=(6, 0, 3))
    assert worst < 1e-5
    assert [cache.window_start(i, 22) for i in range(3)] == [16, 0, 19]
    # a prompt longer than window + block: its first rows see blocks the last row's window leaves
    cache = KVCacheCPU(num_layers=3, num_kv_heads=1, head_dim=16, page_tokens=4, max_tokens=64, block_tokens=4,
                       sliding_window=(6, 0, 3))
    assert run_steps(cache, np.random.default_rng(4), [19, 1, 13], 1, 2, 16, window=(6, 0, 3)) < 1e-5
    for bad in ((6, 0), (6, -1, 3), 0):
        with pytest.raises(HelmcError, match="sliding_window expected None, >= 1 or 3 per-layer windows"):
            KVCacheCPU(num_layers=3, num_kv_heads=1, head_dim=16, sliding_window=bad)


def test_attention_sinks_prefill_decode_and_windows():
    """gpt-oss's sinks (a logit per query head in the denominator), large enough to take much of the weight, over
    prefill and decode, GQA, alternating windows (0: all), fp16 storage; the reference checked against transformers'
    own eager attention once."""
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    rng = np.random.default_rng(11)
    h_kv, h_a, d = 2, 4, 16
    sinks = rng.standard_normal((2, h_a)).astype(np.float32) * 2 + 1
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for n, h in ((9, h_a), (9, h_kv), (9, h_kv)))
    mod = torch.nn.Module()
    mod.sinks, mod.num_key_value_groups, mod.training = torch.tensor(sinks[0]), h_a // h_kv, False
    mask = torch.triu(torch.full((9, 9), float("-inf")), 1)[None, None]
    hf, _ = eager_attention_forward(mod, *(torch.tensor(x).transpose(0, 1)[None] for x in (q, k, v)), mask, 0.3)
    ref = full_attention(q, k, v, 0.3, sinks=sinks[0])
    assert np.abs(hf[0].numpy() - ref).max() < 1e-6 and np.abs(ref - full_attention(q, k, v, 0.3)).max() > 0.05
    for dtype, windows in ((np.float32, (5, 0)), (np.float16, 0)):
        cache = KVCacheCPU(num_layers=2, num_kv_heads=h_kv, head_dim=d, page_tokens=4, max_tokens=64, dtype=dtype,
                           sliding_window=windows or None, block_tokens=8, score_budget_bytes=2048, sinks=sinks)
        assert not cache.uses_kernel
        worst = run_steps(cache, rng, [13, 1, 1, 6, 1, 1], h_kv, h_a, d, kv_dtype=dtype, window=windows, sinks=sinks)
        print(f"\nCPU KV with sinks, {np.dtype(dtype).name}, windows {windows}: max relative error = {worst:.2e}")
        assert worst < 1e-5
    with pytest.raises(HelmcError, match="sinks expected 2 finite vectors of a multiple of 2"):
        KVCacheCPU(num_layers=2, num_kv_heads=2, head_dim=16, sinks=[np.zeros(3), np.zeros(4)])
    cache = KVCacheCPU(num_layers=1, num_kv_heads=2, head_dim=16, sinks=[np.zeros(2)])
    cache.append(0, k[:1], v[:1])
    with pytest.raises(HelmcError, match="2 attention sinks for layer 0 expected one per query head, found 4"):
        cache.attend(0, q[:1], 0.3)


def test_threaded_decode_with_sinks_counts_them_once():
    rng = np.random.default_rng(10)
    sinks = [np.array([3.0, -1.0], np.float32)]
    two = KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=16, page_tokens=64, max_tokens=5000, threads=2,
                     sinks=sinks)
    k, v = rng.standard_normal((2, 4501, 1, 16)).astype(np.float32)
    two.append(0, k[:4500], v[:4500])
    two.advance(4500)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    two.append(0, k[4500:], v[4500:])
    err = float(np.abs(two.attend(0, q, 0.25) - full_attention(q, k, v, 0.25, sinks=sinks[0])).max())
    assert len(_split_by_tokens(two._blocks(0, 4501), 2)) == 2 and err < 1e-5
    two.close()


def test_threaded_decode_equals_single_thread():
    rng = np.random.default_rng(9)
    one = KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=16, page_tokens=64, max_tokens=5000)
    two = KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=16, page_tokens=64, max_tokens=5000, threads=2)
    k, v = rng.standard_normal((2, 4500, 1, 16)).astype(np.float32)
    for c in (one, two):
        c.append(0, k, v)                                      # a prefill need not attend to be committed
        c.advance(4500)
    k1, v1 = rng.standard_normal((2, 1, 1, 16)).astype(np.float32)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    outs = []
    for c in (one, two):
        c.append(0, k1, v1)
        outs.append(c.attend(0, q, 0.25))
    assert len(_split_by_tokens(two._blocks(0, 4501), 2)) == 2       # the two-thread path really splits
    ref = full_attention(q, np.concatenate([k, k1]), np.concatenate([v, v1]), 0.25)
    err = float(np.abs(outs[1] - ref).max())
    print(f"\nthreaded decode over 4501 tokens: max |2 threads - full| = {err:.2e}")
    assert err < 1e-5 and float(np.abs(outs[0] - outs[1]).max()) < 1e-5
    two.close()


def test_misuse_is_refused():
    cache = KVCacheCPU(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=4, max_tokens=8)
    z = np.zeros((3, 1, 8), np.float32)
    with pytest.raises(HelmcError, match="has not appended"):
        cache.append(0, z, z) or cache.attend(1, np.zeros((3, 2, 8), np.float32), 1.0)
    with pytest.raises(HelmcError, match="once per step"):
        cache.append(0, z, z)
    with pytest.raises(HelmcError, match="missing"):
        cache.advance(3)
    cache.append(1, z, z)
    cache.advance(3)
    with pytest.raises(HelmcError, match="room for 8"):
        cache.append(0, np.zeros((6, 1, 8), np.float32), np.zeros((6, 1, 8), np.float32))
    with pytest.raises(HelmcError, match="dtype"):
        KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=8, dtype=np.int8)


def test_sliding_layers_release_pages_exact_ids():
    """A sliding layer kind's pages leave as the window passes them (slots reused lowest first), the global
    layers keep all theirs, and every output still equals full attention over the window."""
    cache = KVCacheCPU(num_layers=3, num_kv_heads=1, head_dim=8, page_tokens=4, max_tokens=64,
                       sliding_window=(6, 0, 6))
    sliding, full = cache.kind_pages(0), cache.kind_pages(1)
    assert cache.kind_pages(2) is sliding and sliding.layers == (0, 2) and full.layers == (1,)
    rng = np.random.default_rng(11)
    hist = []
    ids = lambda kind: (kind.table(0).first_page, kind.table(0).page_ids, kind.table(0).host_slots)
    assert run_steps(cache, rng, [9], 1, 2, 8, window=(6, 0, 6), hist=hist) < 1e-5
    assert ids(sliding) == (1, (1, 2), (1, 2))              # next query (9) sees 4..9: page 0 (0..3) released
    assert ids(full) == (0, (0, 1, 2), (0, 1, 2))
    assert run_steps(cache, rng, [1, 1, 1, 1], 1, 2, 8, window=(6, 0, 6), hist=hist) < 1e-5
    assert ids(sliding) == (2, (2, 3), (2, 0))              # length 13: page 3 took slot 0, then page 1 left
    assert run_steps(cache, rng, [7, 1, 1, 1, 1], 1, 2, 8, window=(6, 0, 6), hist=hist) < 1e-5
    assert cache.length == 24
    assert ids(sliding) == (4, (4, 5), (1, 2))             # page 4 took slot 1, page 5 slot 2
    assert ids(full)[1] == tuple(range(6))
    cache.reset()
    assert ids(sliding) == (0, (), ()) and sliding.pool.host_free == 16


def test_sliding_kind_holds_window_plus_a_page_over_a_long_decode():
    """Decoding many windows long, a sliding kind holds at most ceil(window / T) + 1 pages in a step and writes
    only the arena rows of those slots (what the OS commits); outputs match full attention throughout."""
    T, W = 4, 10
    cache = KVCacheCPU(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=T, max_tokens=200,
                       sliding_window=(W, 0))
    sliding = cache.kind_pages(0)
    rng = np.random.default_rng(5)
    held, slots_used, hist = [], set(), []
    worst = run_steps(cache, rng, [13], 1, 2, 8, window=(W, 0), hist=hist)
    for _ in range(60):
        worst = max(worst, run_steps(cache, rng, [1], 1, 2, 8, window=(W, 0), hist=hist))
        t = sliding.table(0)
        held.append(t.n_pages)
        slots_used.update(t.host_slots)
    assert worst < 1e-5 and cache.length == 73
    assert max(held) == -(-(W - 2) // T) + 1 == 3               # between steps: the next query's W - 1 older keys
    assert slots_used == set(range(sliding.live_pages_bound())) == {0, 1, 2, 3}   # in a step: W keys, 4 pages
    assert sliding.pool.host_free == sliding.pool.host_capacity - sliding.table(0).n_pages
    assert cache.kind_pages(1).table(0).n_pages == 19
