"""gpt-oss's routing on the GPU (helmc_moe_route with topk_first: the k largest logits, then a softmax over those k)
picks what the host's route() picks, in its order (largest first, ties to the lower index, NaN below every number
including -inf), with its weights within 1e-6; the router's bias is already in the logits (post_moe adds it).

Needs only CuPy and a CUDA device."""
from __future__ import annotations

import numpy as np
import pytest

from helmc.model.moe import MoeSpec
from tests.gpu_prebuilt import cuda_device
from tests.runtime.test_moe_route_gpu import grid_logits

pytestmark = pytest.mark.gpu


def gpt_oss_moe(E: int, k: int) -> MoeSpec:
    return MoeSpec(num_experts=E, top_k=k, norm_topk_prob=True, expert_intermediate_size=16, naming="gpt_oss",
                   routing="topk_softmax", router_bias=True, expert_bias=True, expert_act="swiglu_clamped")


@pytest.mark.parametrize("E,k", [(32, 4), (8, 3), (128, 4), (1024, 64), (33, 33), (60, 1)])
def test_gpu_topk_softmax_picks_what_route_picks(E, k):
    cp = cuda_device()
    from helmc.runtime.moe_decode_row import gpu_routes, route_rows, route_rows_to_host
    from helmc.runtime.moe_experts import route
    moe = gpt_oss_moe(E, k)
    assert gpu_routes(moe)
    logits = grid_logits(np.random.default_rng(E * 7 + k), 2048, E)
    logits[5::19, E // 2] = -np.inf                                    # -inf ranks above NaN, below every number
    logits[8::23, :] = -np.inf                                         # a row of -inf: experts 0..k-1, NaN weights
    want_idx, want_w = route(logits, moe)
    sel, w = route_rows(cp.asarray(logits), moe)
    got_idx, got_w = sel.get(), w.get()
    bad = np.nonzero((got_idx != want_idx).any(axis=1))[0]
    assert bad.size == 0, (bad[:5], got_idx[bad[:2]], want_idx[bad[:2]], logits[bad[:2]])
    finite = ~np.isnan(want_w).any(axis=1)
    assert 0 < (~finite).sum() < len(finite)
    assert np.array_equal(np.isnan(got_w), np.isnan(want_w))
    np.testing.assert_allclose(got_w[finite], want_w[finite], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_w[finite].sum(axis=1), 1.0, rtol=1e-5)
    # not the softmax over all experts: the weights of the k alone sum to 1 even unnormalised
    host_idx, host_w = route_rows_to_host(cp.asarray(logits), moe)
    assert host_idx.dtype == want_idx.dtype and host_w.dtype == np.float32
    assert np.array_equal(host_idx, want_idx) and np.array_equal(host_w, got_w, equal_nan=True)


def test_gpu_topk_softmax_on_random_logits_with_a_router_bias():
    """Random router logits as post_moe gives them (bias added): the weights to rounding, the picks exact."""
    cp = cuda_device()
    from helmc.runtime.moe_decode_row import route_rows
    from helmc.runtime.moe_experts import route
    rng = np.random.default_rng(3)
    moe = gpt_oss_moe(32, 4)
    logits = (rng.standard_normal((4096, 32)) * 3 + rng.standard_normal(32) * 2).astype(np.float32)
    want_idx, want_w = route(logits, moe)
    sel, w = route_rows(cp.asarray(logits), moe)
    assert np.array_equal(sel.get(), want_idx)
    np.testing.assert_allclose(w.get(), want_w, rtol=0, atol=1e-6)
    # softmax_topk's weights differ from these where the other experts hold mass: the mode is really switched
    other = route(logits, MoeSpec(num_experts=32, top_k=4, norm_topk_prob=False, expert_intermediate_size=16))[1]
    assert np.abs(other - want_w).max() > 0.05
