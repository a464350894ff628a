"""Streaming paged attention (runtime/kv/paged_attention.py) against full softmax, in float64.

The references are computed here from scratch (full_attention: scores, one softmax, weighted sum);
there are no stored reference files to regenerate. Each test prints its max difference."""
import numpy as np
import pytest

from helmc.runtime.kv.paged_attention import (KeyBlock, ListPageSource, attend_blocks, contiguous_blocks,
                                           full_attention, group_queries, merge_partials, partial_attention,
                                           streaming_attention_decode, ungroup_output)

SCORES = [2.0, 4.0, 1.0, 0.0, 1.0, 2.0]
VALUES = [10.0, 30.0, 5.0, 2.0, 8.0, 12.0]


def six_token_pages(tokens_per_page):
    """Thesis Table 4.2: d = 1, q = 1, scale 1, so token i's key is its score and its value is v_i."""
    k = np.array(SCORES).reshape(1, 6, 1)                    # [h_kv=1, n=6, d=1]
    v = np.array(VALUES).reshape(1, 6, 1)
    return [(k[:, a:a + tokens_per_page], v[:, a:a + tokens_per_page]) for a in range(0, 6, tokens_per_page)]


def test_thesis_six_token_example():
    q = np.ones((1, 1))
    trace = []
    streamed = streaming_attention_decode(q, ListPageSource(six_token_pages(1)), 1.0, trace)[0, 0]
    full = full_attention(q[None], np.array(SCORES).reshape(6, 1, 1), np.array(VALUES).reshape(6, 1, 1), 1.0)[0, 0, 0]
    by_pages_of_3 = streaming_attention_decode(q, ListPageSource(six_token_pages(3)), 1.0)[0, 0]
    print(f"\nsix-token example: streaming {streamed:.6f}, full softmax {full:.6f}, pages of 3 {by_pages_of_3:.6f}"
          f" (thesis: 24.2); |streaming - full| = {abs(streamed - full):.2e}")
    assert round(streamed, 1) == 24.2 and round(full, 1) == 24.2
    assert abs(streamed - full) < 1e-12 and abs(by_pages_of_3 - full) < 1e-12
    # Table 4.2's streaming column; the thesis rounds each printed step (its last s reads 1.388
    # where the exact value is 1.3886), hence the tolerances
    m, s, o = (np.array(x) for x in zip(*[(t[0][0], t[1][0], t[2][0, 0]) for t in trace]))
    assert list(m) == [2, 4, 4, 4, 4, 4]
    assert np.allclose(s, [1.000, 1.135, 1.185, 1.203, 1.253, 1.388], atol=1.5e-3)
    assert np.allclose(o, [10.00, 31.35, 31.60, 31.64, 32.04, 33.66], atol=1e-2)


def random_paged_context(rng, h_kv, d, page_tokens, n):
    k = rng.standard_normal((n, h_kv, d))
    v = rng.standard_normal((n, h_kv, d))
    pages = [(k[a:a + page_tokens].transpose(1, 0, 2), v[a:a + page_tokens].transpose(1, 0, 2))   # [n_i,h_kv,d] -> [h_kv,n_i,d]
             for a in range(0, n, page_tokens)]
    return k, v, pages


@pytest.mark.parametrize("group", [1, 4, 8])
def test_streaming_equals_full_random_pages(group):
    rng = np.random.default_rng(group)
    worst = 0.0
    for trial in range(6):
        h_kv, d = int(rng.integers(1, 4)), int(rng.choice([8, 16, 64]))
        page_tokens = int(rng.integers(1, 40))
        n = int(rng.integers(1, 6)) * page_tokens + int(rng.integers(1, page_tokens + 1))   # last page partly filled
        k, v, pages = random_paged_context(rng, h_kv, d, page_tokens, n)
        q = rng.standard_normal((h_kv * group, d)) * 2
        src = ListPageSource(pages)
        got = streaming_attention_decode(q, src, 1 / np.sqrt(d))
        ref = full_attention(q[None], k, v, 1 / np.sqrt(d))[0]
        worst = max(worst, float(np.abs(got - ref).max()))
        assert src.max_live <= 2, "Algorithm 3 keeps at most the current page and the next one"
        assert src.order[:3] == [("prefetch", 0), ("wait", 0), ("prefetch", 1) if len(pages) > 1 else ("release", 0)]
    print(f"\nGQA ratio {group}: max |streaming - full| over 6 random contexts = {worst:.2e}")
    assert worst < 1e-6


@pytest.mark.parametrize("group,window", [(1, 0), (4, 0), (8, 0), (4, 7)])
def test_prefill_blocks_causal_equals_full(group, window):
    rng = np.random.default_rng(10 + group + window)
    h_kv, d = 2, 16
    past, S = 23, 41                                          # 23 cached tokens, 41 new query rows
    n = past + S
    k = rng.standard_normal((n, h_kv, d))
    v = rng.standard_normal((n, h_kv, d))
    q = rng.standard_normal((S, h_kv * group, d))
    kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)       # [n, h_kv, d] -> [h_kv, n, d]
    blocks, a = [], 0
    for size in [5, 9, 1, 13, 30, 6]:                         # uneven blocks covering 0..63
        blocks.append(KeyBlock(a, size, (lambda a=a, size=size: (kt[:, a:a + size], vt[:, a:a + size]))))
        a += size
    assert a == n
    # a tiny score budget forces one query row per tile: no tile ever holds S x n scores
    got = attend_blocks(np, q, past, blocks, h_kv, 0.25, window, np.float64, score_budget_bytes=1)
    ref = full_attention(q, k, v, 0.25, q_pos0=past, window=window)
    err = float(np.abs(got - ref).max())
    print(f"\nprefill over blocks, GQA {group}, window {window}: max |blocks - full| = {err:.2e}")
    assert err < 1e-10
    got_big = attend_blocks(np, q, past, contiguous_blocks(kt, vt, 0, 16), h_kv, 0.25, window, np.float64)
    assert float(np.abs(got_big - ref).max()) < 1e-10


def test_split_k_merge_equals_full():
    rng = np.random.default_rng(3)
    h_kv, g, d, n = 2, 4, 32, 300
    k = rng.standard_normal((n, h_kv, d))
    v = rng.standard_normal((n, h_kv, d))
    q = rng.standard_normal((1, h_kv * g, d))
    kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)       # [n, h_kv, d] -> [h_kv, n, d]
    qt = group_queries(np, q, h_kv)                           # [1, h_a, d] -> [h_kv, g, d]
    cuts = [0, 7, 150, 151, 300]
    parts = [partial_attention(np, qt, None, 1, contiguous_blocks(kt[:, a:b], vt[:, a:b], a, 64), 0.2,
                               compute_dtype=np.float64) for a, b in zip(cuts, cuts[1:])]
    got = ungroup_output(merge_partials(np, parts), 1)
    err = float(np.abs(got - full_attention(q, k, v, 0.2)).max())
    print(f"\nsplit-K over 4 ranges then merge: max |merged - full| = {err:.2e}")
    assert err < 1e-12
