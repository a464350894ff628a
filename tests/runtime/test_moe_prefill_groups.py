"""A prompt's (row, expert) pairs grouped by expert for the GPU's expert prefill (moe_prefill.group_pairs): one
gather makes each expert's rows a contiguous slice, and the combine over pos / weights (each row's experts
ascending) gives the bits of adding each expert's weighted rows in turn, as the per-expert loop did. The GPU side
(the gather, the staging ring, the combine kernel) is tested against the same loop in tests/runtime/test_moe_gpu.py,
the same grouping in CuPy against NumPy's in tests/runtime/test_moe_route_gpu.py."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helmc.runtime.moe_prefill import group_pairs


def routed(rng, S: int, E: int, k: int):
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.random((S, k), dtype=np.float32)
    return idx, w / w.sum(axis=1, keepdims=True)


def expert(e: int, x: np.ndarray) -> np.ndarray:
    """A row-wise stand-in for expert e: its output row depends on its input row and e only."""
    return np.tanh(x * np.float32(0.5 + 0.1 * e) + np.float32(e)).astype(np.float32)


def per_expert(h, m, idx, w):
    """The per-expert loop: h[rows_e] += w * expert(m[rows_e]) for each expert, ascending."""
    h = h.copy()
    for e in np.unique(idx):
        rows, slot = np.nonzero(idx == e)
        h[rows] += w[rows, slot, None] * expert(int(e), m[rows])
    return h


def grouped(h, m, idx, w, E):
    """group_pairs' gather, expert slices and combine (the GPU's kernels' arithmetic in NumPy)."""
    g = group_pairs(idx, w, E)
    xs = m[g.rows]                                               # [S k, H]
    ys = np.empty_like(xs)
    for e in g.used():
        a, b = g.starts[e], g.starts[e + 1]
        ys[a:b] = expert(e, xs[a:b])
    h = h.copy()
    for j in range(idx.shape[1]):
        h += g.weights[:, j, None] * ys[g.pos[:, j]]
    return h, g


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 16), st.data())
def test_grouped_combine_is_the_per_expert_loop_bit_for_bit(S, E, data):
    k = data.draw(st.integers(1, E))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31)))
    idx, w = routed(rng, S, E, k)
    m = rng.standard_normal((S, 24)).astype(np.float32)
    h = rng.standard_normal((S, 24)).astype(np.float32)
    got, g = grouped(h, m, idx, w, E)
    assert np.array_equal(got, per_expert(h, m, idx, w))
    # the layout: each expert's pairs contiguous with rows ascending; pos a permutation naming each row's pairs,
    # its experts ascending, with their weights
    assert g.starts[0] == 0 and g.starts[-1] == S * k and np.all(np.diff(g.starts) >= 0)
    for e in range(E):
        rows = g.rows[g.starts[e]:g.starts[e + 1]]
        assert np.array_equal(rows, np.nonzero((idx == e).any(axis=1))[0])
    assert sorted(g.pos.ravel().tolist()) == list(range(S * k))
    assert np.array_equal(g.rows[g.pos], np.repeat(np.arange(S)[:, None], k, axis=1))
    expert_of = np.searchsorted(g.starts, g.pos, side="right") - 1
    assert np.array_equal(expert_of, np.sort(idx, axis=1))
    assert np.array_equal(g.weights, np.take_along_axis(w, np.argsort(idx, axis=1), axis=1))
    assert g.used() == sorted(set(idx.ravel().tolist()))


def test_the_routing_kernels_int32_picks_group_as_route_s_int64_ones():
    """The GPU's router gives int32 picks, route() int64: the same pairs group into the same arrays and dtypes."""
    idx, w = routed(np.random.default_rng(3), 2048, 128, 8)
    a, b = group_pairs(idx, w, 128), group_pairs(idx.astype(np.int32), w, 128)
    for f in ("rows", "starts", "pos", "weights"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a.rows.dtype == np.int32 and a.pos.dtype == np.int32 and a.weights.dtype == np.float32
    assert a.pos.flags.c_contiguous and a.weights.flags.c_contiguous      # what the combine kernel reads raw
    assert np.array_equal(a.counts(), np.bincount(idx.ravel(), minlength=128))


def test_expert_calls_see_a_few_dozen_row_counts():
    """Every count 1..16384 maps to a bucket at least as large and at most a quarter (or 16 rows) more, and the
    buckets number a few an octave: the GPU library's pooled allocator keeps one freed buffer per size it sees."""
    from helmc.runtime.moe_prefill import bucket_rows
    buckets = {bucket_rows(n) for n in range(1, 16385)}
    for n in range(1, 16385):
        b = bucket_rows(n)
        assert n <= b <= max(16, n + n // 4 + 1), (n, b)
    assert len(buckets) <= 4 * 11 + 1, sorted(buckets)
    assert bucket_rows(16) == 16 and bucket_rows(17) == 20 and bucket_rows(2048) == 2048 and bucket_rows(2049) == 2560
