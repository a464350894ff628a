"""Planning a mixture of experts (helmc/planner/moe.py) for Qwen3-30B-A3B's published configuration on the H200 preset:
what is not an expert is placed by the split search, the experts stay in host RAM for the CPU except the whole
experts the VRAM budget leaves room for, the same count in every routed block, and their time and memory are added to
every candidate alike. Pure Python: no weights, no TVM."""
from __future__ import annotations

import dataclasses
import json

import pytest

from helmc.errors import HelmcError
from helmc.hardware.profile import load_hardware
from helmc.model.spec import ModelSpec
from helmc.planner.moe import distinct_share, expert_bytes
from helmc.planner.search_partition import plan
from helmc.runtime.bundle.plan import Plan

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
          "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
          "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
          "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16", "hidden_act": "silu"}
EXPERT = 3 * 768 * 2048 * 2            # one bf16 expert's gate, up and down


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_hf_config(CONFIG)


@pytest.mark.parametrize("budget", [4, 8, 24])
def test_experts_fill_what_the_budget_leaves(spec, budget):
    p = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=budget)
    assert p.placement.cpu_units <= 1 and not p.placement.groups and not p.placement.prefill_on_gpu        # attention and head on the GPU
    assert p.memory.gpu_bytes <= budget * 2**30
    counts = {len(ids) for ids in p.placement.gpu_experts}
    assert len(counts) <= 1, counts                                             # the same count in every block
    n = counts.pop() if counts else 0
    vram = 48 * n * EXPERT
    assert expert_bytes(spec) == 48 * 128 * EXPERT
    assert p.memory.gpu_weight_bytes - vram < budget * 2**30 and p.memory.cpu_weight_bytes >= expert_bytes(spec) - vram
    # no room for one more expert per block beside the KV the workload needs
    assert p.memory.usable_vram_bytes - p.memory.gpu_bytes < 48 * EXPERT + p.memory.gpu_kv_pool_bytes
    # a prompt's host experts stream through a ring of 2 x 16 experts, counted before any expert is placed, where
    # the VRAM left holds it (4 GiB of bf16 attention and head leave too little: the CPU computes those prompts)
    assert p.memory.expert_staging_bytes == (0 if budget == 4 else 2 * 16 * EXPERT)
    assert p.placement.prefill_chunk_tokens == 2048                                       # the prompt in one chunk



def test_a_larger_budget_holds_more_experts_and_predicts_a_faster_token(spec):
    plans = [plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=b) for b in (4, 8, 24)]
    held = [len(p.placement.gpu_experts[0]) if p.placement.gpu_experts else 0 for p in plans]
    assert held[0] < held[1] < held[2] <= 128, held
    assert plans[0].predictions.t_plan_ms > plans[1].predictions.t_plan_ms > plans[2].predictions.t_plan_ms
    whole = plan(spec, "h200-profiled", prompt_len=2048, output_len=64)         # the whole H200: every expert
    assert {len(ids) for ids in whole.placement.gpu_experts} == {128}
    assert whole.memory.expert_staging_bytes == 0                                      # nothing left on the host to stream


def test_the_experts_add_the_same_to_every_candidate(spec):
    p = plan(spec, "h200-profiled", gpu_budget_gib=8)
    feasible = [c for c in p.predictions.candidates if c.feasible]
    assert min(feasible, key=lambda c: c.t_plan_ms).cpu_units == p.placement.cpu_units
    assert all(c.cpu_bytes >= expert_bytes(spec) for c in p.predictions.candidates)


def test_plan_json_round_trip_and_bad_expert_lists(spec):
    p = plan(spec, "h200-profiled", gpu_budget_gib=8)
    assert Plan.from_json(p.to_json()) == p and '"gpu_experts"' in p.to_json()
    dense = plan(ModelSpec.from_hf_config({**CONFIG, "architectures": ["Qwen3ForCausalLM"]}), "h200-profiled")
    assert dense.placement.gpu_experts == () and json.loads(dense.to_json())["placement"]["gpu_experts"] == []
    with pytest.raises(HelmcError, match="gpu_experts of block 3 expected increasing expert indices"):
        p.replace(gpu_experts=p.placement.gpu_experts[:3] + ((5, 2),) + p.placement.gpu_experts[4:])
    with pytest.raises(HelmcError, match="gpu_experts expected one entry per block \\(48\\), found 2"):
        p.replace(gpu_experts=((1,), (2,)))


def test_experts_that_do_not_fit_in_host_ram_are_one_line(spec):
    hw = load_hardware("h200-profiled")
    small = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, ram_free_bytes=8 * 2**30))
    with pytest.raises(HelmcError) as e:
        plan(spec, small, gpu_budget_gib=8)
    assert "\n" not in str(e.value) and "GiB" in str(e.value)


def test_uniform_routing_share():
    s = ModelSpec.from_hf_config(CONFIG)
    assert distinct_share(s, 1) == pytest.approx(8 / 128)
    assert distinct_share(s, 8) == pytest.approx(1 - (120 / 128) ** 8)


def test_the_vram_expert_cache_is_on_wherever_experts_are_on_both_sides(spec):
    one = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=8)
    assert 0 < len(one.placement.gpu_experts[0]) < 128 and one.placement.expert_cache
    # every expert's host rows stay bound (the cache sends experts back): host RAM counts all of them
    assert one.memory.cpu_weight_bytes >= expert_bytes(spec)
    batched = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=8, batch=8)
    assert 0 < len(batched.placement.gpu_experts[-1]) < 128 and batched.placement.expert_cache   # served batches too
    whole = plan(spec, "h200-profiled", prompt_len=2048, output_len=64)
    assert not whole.placement.expert_cache                                           # nothing on the host to cache
