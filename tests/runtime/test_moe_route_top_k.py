"""The router's top-k without sorting whole rows (moe_experts.top_k) picks and orders exactly what the stable sort
does (largest first, ties to the lower index), ties at the boundary, NaN and signed zeros included, and route()
over a prompt's rows keeps its results."""
from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from helmc.model.moe import MoeSpec
from helmc.runtime.moe_experts import route, top_k


def stable(p: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-p, axis=-1, kind="stable")[:, :k]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(1, 40), st.data())
def test_equals_the_stable_sort_on_tie_heavy_rows(k, E, data):
    S = data.draw(st.integers(1, 16))
    # few distinct values: most rows tie somewhere, many at the k-th place
    values = st.sampled_from([0.0, -0.0, 0.25, 0.5, 1.0, -1.0, 3.0, float("nan")])
    p = data.draw(arrays(np.float32, (S, E), elements=values))
    got = top_k(p, min(k, E))
    want = stable(p, min(k, E))
    assert got.dtype == want.dtype and np.array_equal(got, want), (p, got, want)


def test_equals_the_stable_sort_on_a_prompts_router_rows():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2048, 128)).astype(np.float32)
    logits[::7, 5] = logits[::7, 9]                     # ties inside the top k and at its boundary
    logits[::11, :] = np.round(logits[::11, :])
    for k in (1, 2, 8, 127):
        assert np.array_equal(top_k(logits, k), stable(logits, k))
    for routing, norm in (("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)):
        moe = MoeSpec(128, 8, norm, 64, routing=routing)
        idx, w = route(logits, moe)
        if routing == "softmax_topk":
            z = logits - logits.max(axis=-1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=-1, keepdims=True)
            assert np.array_equal(idx, stable(p, 8))
            ref = np.take_along_axis(p, idx, axis=-1)
            ref = ref / ref.sum(axis=-1, keepdims=True) if norm else ref
            assert np.array_equal(w, ref.astype(np.float32))
        else:
            assert np.array_equal(idx, stable(logits, 8))


def test_faster_than_sorting_whole_rows():
    p = np.random.default_rng(1).random((2048, 128), dtype=np.float32)

    def best(f):
        out = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            out.append(time.perf_counter() - t)
        return min(out)
    fast, full = best(lambda: top_k(p, 8)), best(lambda: stable(p, 8))
    print(f"\ntop 8 of [2048, 128]: {fast * 1e3:.2f} ms, the stable sort {full * 1e3:.2f} ms")
    assert fast < full / 2
