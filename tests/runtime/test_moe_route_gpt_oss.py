"""gpt-oss's routing and expert values in MoeSpec: the router's top-k then a softmax over those k logits (route's
"topk_softmax") against transformers' own GptOssTopKRouter (bias included), and bad values refused in one line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helmc.errors import HelmcError
from helmc.model.moe import MoeSpec
from helmc.runtime.moe_experts import route

GPT_OSS = MoeSpec(num_experts=32, top_k=4, norm_topk_prob=False, expert_intermediate_size=64,
                  routing="topk_softmax", router_bias=True, expert_bias=True, expert_act="swiglu_clamped")


def test_topk_softmax_matches_transformers_router():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    torch.manual_seed(0)
    router = GptOssTopKRouter(GptOssConfig(hidden_size=48, num_local_experts=32, num_experts_per_tok=4))
    torch.nn.init.normal_(router.weight, std=0.5)
    torch.nn.init.normal_(router.bias, std=1.0)
    h = torch.randn(40, 48)
    with torch.no_grad():
        logits, weights, experts = router(h)
    idx, w = route(logits.numpy(), GPT_OSS)
    assert idx.shape == w.shape == (40, 4) and w.dtype == np.float32
    assert np.array_equal(idx, experts.numpy())
    np.testing.assert_allclose(w, weights.numpy(), rtol=2e-7, atol=1e-7)
    # not the softmax-over-all routing with the k renormalised in another order of operations: the same experts,
    # weights equal within rounding, but the sum over all is not what picks them
    other_idx, other_w = route(logits.numpy(), dataclasses.replace(GPT_OSS, routing="softmax_topk", norm_topk_prob=True))
    assert np.array_equal(other_idx, idx) and np.allclose(other_w, w, atol=1e-6)
    unnormalised = route(logits.numpy(), dataclasses.replace(GPT_OSS, routing="softmax_topk"))[1]
    assert np.abs(unnormalised - w).max() > 0.05


@pytest.mark.parametrize("over,expected", [
    (dict(routing="sigmoid"), "moe routing expected one of ('softmax_topk', 'topk_softmax'), found 'sigmoid'"),
    (dict(expert_act="gelu"), "moe expert_act expected one of ('silu', 'swiglu_clamped'), found 'gelu'"),
    (dict(swiglu_limit=0.0), "moe swiglu_limit expected a positive finite number, found 0.0"),
    (dict(swiglu_alpha=float("inf")), "moe swiglu_alpha expected a positive finite number, found inf"),
])
def test_bad_values_are_one_line(over, expected):
    with pytest.raises(HelmcError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(GPT_OSS, **over)
