"""Planning gpt-oss-20b (its published configuration: 24 blocks, 32 biased, clamped experts a block, top-4; typed as
llama.cpp's file: Q8_0 attention, MXFP4 experts) on the H200 preset: the blocks go to the GPU, the total stays within
the budget, and whole experts go to VRAM only where they fit (some at 8 GiB, all 32 on the whole GPU), the same count
in every block; each GPU cache layer keeps its block's own window (sliding on even blocks, global on odd ones). Pure
Python: no weights, no TVM."""
from __future__ import annotations

import pytest

from helmc.model.spec import ModelSpec
from helmc.planner.moe import expert_bytes
from helmc.planner.search_partition import plan
from helmc.testing import gguf_typed_gpt_oss, gpt_oss_20b_config


@pytest.fixture(scope="module")
def spec():
    """gpt-oss-20b typed as llama.cpp's file (the one people run): Q8_0 attention, MXFP4 experts."""
    return gguf_typed_gpt_oss(ModelSpec.from_hf_config(gpt_oss_20b_config()))


@pytest.fixture(scope="module")
def plans(spec):
    return {b: plan(spec, "h200-profiled", prompt_len=2048, output_len=64, **({"gpu_budget_gib": b} if b else {}))
            for b in (4, 8, None)}


@pytest.mark.parametrize("budget", [4, 8, None])
def test_blocks_go_to_the_gpu_within_the_budget(spec, plans, budget):
    p = plans[budget]
    pl, mem = p.placement, p.memory
    assert len(pl.gpu_layers) == spec.num_layers and pl.head_on_gpu and pl.cpu_units <= 1
    assert not pl.groups and not pl.prefill_on_gpu                 # a MoE's plain CPU/GPU split (check_placement)
    # a prompt of any length prefills in whole chunks (the plans are made for 128-token prompts): its experts are
    # streamed and dequantized once per chunk
    from helmc.planner.moe import MOE_PREFILL_CHUNK_TOKENS
    assert pl.prefill_chunk_tokens == MOE_PREFILL_CHUNK_TOKENS == 2048
    assert mem.gpu_bytes <= (budget * 2**30 if budget else mem.usable_vram_bytes)
    assert p.predictions.t_plan_ms > 0
    counts = {len(ids) for ids in pl.gpu_experts}
    assert len(counts) <= 1, counts                                # the same count in every routed block
    n = counts.pop() if counts else 0
    one = expert_bytes(spec) // (spec.num_layers * spec.moe.num_experts)
    assert one >= 3 * 2880 * 2880 * 17 // 32                      # MXFP4 gate, up, down (and their biases)
    # experts in VRAM only where whole ones fit: the bytes left beside the KV cache hold no further expert a block
    assert mem.gpu_weight_bytes >= spec.num_layers * n * one
    if n < spec.moe.num_experts:
        assert mem.usable_vram_bytes - mem.gpu_bytes < spec.num_layers * one + mem.gpu_kv_pool_bytes
    assert (n == 32) == (budget is None) and (budget != 8 or n > 0), n
    # a prompt's host experts stream to the GPU through a ring of two groups of slots (gate, up, down each) beside
    # every expert's biases of the GPU blocks; none where every expert is in VRAM (nothing streams)
    from helmc.planner.moe import EXPERT_STAGING_EXPERTS, EXPERT_STAGING_GROUPS
    biases = spec.num_layers * 32 * (2 * 2880 + 2880) * 2
    ring = EXPERT_STAGING_GROUPS * EXPERT_STAGING_EXPERTS * one
    assert mem.expert_staging_bytes == (0 if n == 32 else ring + biases), (mem.expert_staging_bytes, ring, biases)
    # nor the VRAM expert cache: its slots are refreshed by the int8 GPU expert kernels' decode rows alone
    assert not pl.expert_cache


def test_a_larger_budget_predicts_a_faster_token(plans):
    t = [plans[b].predictions.t_plan_ms for b in (4, 8, None)]
    assert t[0] >= t[1] > t[2], t


def test_the_gpu_cache_keeps_each_blocks_window(spec, plans):
    from helmc.runtime.gpu_session import gpu_cache_windows
    windows = gpu_cache_windows(spec, plans[None].placement)
    assert windows == (128, 0) * 12
