"""Mixture of experts on the CPU stage against Hugging Face transformers: a tiny random Qwen3MoeForCausalLM in its
real structure (8 experts, top-2, normalised top-k, 3 blocks of which block 1 is dense through mlp_only_layers),
built and run with helmc. fp32: prefill logits within the dense tests' 1e-4 relative max error and 24 greedy
tokens identical; fp16 and bf16 weights: 24 greedy tokens identical. A batched decode step of several sequences is
bit-identical to each sequence's single run. The router's top-k against transformers' own router module. The
references are recomputed from transformers on every run; nothing is stored.
"""
from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest
import torch

from batch_decode_checks import batched_runs, compare, prompts, single_runs
from test_end_to_end import PROMPT, hf_greedy, hf_logits

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec

pytest.importorskip("tvm.relax")
NEW_TOKENS = 24


def qwen3_30b_a3b_config(**over) -> dict:
    """config.json of Qwen3-30B-A3B as published (the keys helmc reads)."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
           "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "hidden_act": "silu"}
    cfg.update(over)
    return cfg


def test_spec_reads_the_expert_layout():
    spec = ModelSpec.from_hf_config(qwen3_30b_a3b_config())
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.expert_intermediate_size) == (128, 8, True, 768)
    assert moe.dense_layers == () and moe.num_shared_experts == 0 and spec.qk_norm
    assert ModelSpec.from_json(spec.to_json()) == spec
    shapes = spec.block_weight_shapes(0)
    assert shapes["mlp.gate.weight"] == (128, 2048) and shapes["mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert "mlp.gate_proj.weight" not in shapes
    # bf16: the norms, q/k/v, q/k norms, o_proj, then the router and 128 experts x (gate, up, down)
    attention = 2048 + 4096 * 2048 + 2 * 512 * 2048 + 2 * 128 + 2048 * 4096 + 2048
    assert spec.block_weight_bytes(0) == 2 * (attention + 128 * 2048 + 128 * 3 * 768 * 2048)
    sparse = ModelSpec.from_hf_config(qwen3_30b_a3b_config(decoder_sparse_step=2, mlp_only_layers=[5]))
    assert sparse.moe.dense_layers[:4] == (0, 2, 4, 5) and not sparse.is_moe_layer(5) and sparse.is_moe_layer(3)
    assert sparse.post_attn_weight_names(4)[-1] == "mlp.down_proj.weight"
    assert sparse.post_attn_weight_names(3) == ("self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                                "mlp.gate.weight")
    assert sparse.architecture_hash() != spec.architecture_hash()


@pytest.mark.parametrize("over,expected", [
    (dict(num_experts_per_tok=200), "top_k expected at most num_experts (128)"),
    (dict(num_experts="many"), "'num_experts' expected a non-negative integer"),
    (dict(mlp_only_layers=[48]), "mlp_only_layers expected a list of block indices below 48"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob expected true or false"),
    (dict(moe_intermediate_size=None), "'moe_intermediate_size' expected a non-negative integer"),
])
def test_bad_expert_layout_is_one_line(over, expected):
    with pytest.raises(HelmcError, match=re.escape(expected)) as e:
        ModelSpec.from_hf_config(qwen3_30b_a3b_config(**over))
    assert "\n" not in str(e.value)


def test_router_top_k_matches_transformers():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    from helmc.model.moe import MoeSpec
    from helmc.runtime.moe_experts import route
    for norm in (True, False):
        torch.manual_seed(1)
        cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(router.weight, std=0.5)
        h = torch.randn(40, 32)
        with torch.no_grad():
            logits, weights, experts = router(h)
        idx, w = route(logits.numpy(), MoeSpec(16, 4, norm, 8))
        assert np.array_equal(idx, experts.numpy())
        np.testing.assert_allclose(w, weights.numpy(), rtol=1e-6, atol=1e-7)
        assert len(np.unique(idx)) == 16 and np.allclose(w.sum(-1), 1.0) == norm


@pytest.fixture(scope="module")
def cpu_hardware(host_hardware):
    return dataclasses.replace(host_hardware, gpu=None, link=None)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, cpu_hardware, cache_dir):
    """dtype -> (Session, transformers model in fp32 over the same weights); each built once."""
    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    made = {}

    def get(dtype: str, batch: int = 1, arch: str = "qwen3_moe"):
        if (dtype, batch, arch) not in made:
            d = str(tmp_path_factory.mktemp(f"{arch}-{dtype}") / "model")
            # seed 3: a Mixtral whose 24 greedy tokens are not one token repeated (a weak comparison)
            ref = make_tiny_model(d, arch, num_layers=3, dtype=dtype, seed=3 if arch == "mixtral" else 0).float().eval()
            r = api.build(d, cpu_hardware, d + ".bundle", cache_dir=cache_dir, quiet=True, batch=batch)
            assert r.plan.placement.cpu_units == r.spec.num_units
            assert r.spec.moe.dense_layers == ((1,) if arch == "qwen3_moe" else ())
            made[dtype, batch, arch] = Session.load(r.bundle_dir), ref
        return made[dtype, batch, arch]
    return get


def test_fp32_logits_greedy_and_batched_decode_match(moe_model):
    s, ref = moe_model("float32", batch=4)
    ours = s.forward(PROMPT, all_logits=True)
    theirs = hf_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"qwen3_moe fp32: prefill logits max rel diff {rel:.3e}")
    assert ours.shape == theirs.shape and rel <= 1e-4
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    assert s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens == expected
    assert len(set(expected)) > 4, "degenerate reference: the test would not catch a wrong model"
    ps = prompts(s.spec.vocab_size, 6)
    singles = single_runs(s, ps, 8)
    batched, sizes = batched_runs(s, ps, 8, max_batch=4, stagger=1)
    assert {2, 3, 4} <= set(sizes), sizes                # padded (3 -> 4) and exact steps both ran
    compare(singles, batched, "qwen3_moe fp32")
    # the serve engine's joint prefill of several prompts (their rows share each expert's call): each prompt's
    # logits bit-identical to its lone prefill
    from helmc.runtime.serve.batch_model import BatchModel
    m = BatchModel(s, 4)
    joint = m.prefill_many([(slot, p) for slot, p in enumerate(ps[:4])])
    for slot, (p, row) in enumerate(zip(ps[:4], joint)):
        m.free(slot)
        assert np.array_equal(row, singles[slot][0]), f"prompt {slot}: joint prefill differs from its lone prefill"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_greedy_matches_transformers(moe_model, dtype):
    s, ref = moe_model(dtype)
    ours = s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    # transformers in fp32 over the 16-bit weights: helmc's CPU stage keeps fp32 activations too
    assert ours == hf_greedy(ref, PROMPT, NEW_TOKENS)


def test_mixtral_is_the_same_code_with_other_values(moe_model):
    s, ref = moe_model("float32", arch="mixtral")
    assert (s.spec.moe.naming, s.spec.moe.norm_topk_prob, s.spec.qk_norm) == ("mixtral", True, False)
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    assert s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens == expected
    assert len(set(expected)) > 4


def test_missing_expert_is_one_line(tmp_path):
    """Weights without one expert's tensor (config.json and the weights disagree): refused before anything loads."""
    from safetensors.numpy import load_file, save_file
    from helmc.compiler.read_model import read_model
    from helmc.testing import make_tiny_model
    d = str(tmp_path / "model")
    make_tiny_model(d, "qwen3_moe", num_layers=2)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(HelmcError, match="model.layers.1.mlp.experts.5.up_proj.weight") as e:
        read_model(d)
    assert "\n" not in str(e.value)


def test_streamed_prefill_plan_is_refused(tmp_path, cache_dir):
    """A MoE model's GPU blocks run attention on the GPU and the experts on the CPU (tests/runtime/test_moe_gpu.py);
    a plan that streams CPU blocks to the GPU for prefill is refused in one line before anything compiles."""
    from helmc.compiler.pipeline import build, search_plan
    from helmc.hardware.profile import HardwareProfile
    from helmc.testing import make_tiny_model
    from helmc.hardware.profile import PRESET_DIR
    with open(os.path.join(PRESET_DIR, "l40s-epyc.json")) as f:
        hw = HardwareProfile.from_json(f.read())
    d = str(tmp_path / "model")
    make_tiny_model(d, "qwen3_moe", num_layers=2)
    spec = ModelSpec.from_model_dir(d)
    own = search_plan(spec, hw, 128, 128, hybrid=False)
    assert not own.placement.prefill_on_gpu and not own.placement.groups         # the planner makes a plain split for a MoE model
    plan = own.replace(cpu_units=2, groups=(), candidates=(), prefill_on_gpu=True,
                               prefill_staging_bytes=1 << 20)
    from helmc.runtime.bundle.plan_check import check_plan
    with pytest.raises(HelmcError, match="^--plan: a mixture-of-experts model .* expected a plain CPU/GPU split, "
                                         "found a streamed prefill$"):     # a --plan file asking for it, at load
        check_plan(plan, spec, own, where="--plan")
    with pytest.raises(HelmcError, match="mixture-of-experts model .* expected a plain CPU/GPU split") as e:
        build(d, hw, str(tmp_path / "bundle"), cache_dir=cache_dir, quiet=True, plan=plan)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "bundle")
