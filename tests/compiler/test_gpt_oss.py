"""gpt-oss (GptOssForCausalLM) from a Hugging Face directory, built for the CPU: q/k/v and o_proj biases, attention
sinks (a logit per query head in the softmax's denominator), sliding blocks (window 8) alternating with full ones,
head_dim 32 != hidden / heads, YaRN RoPE, and experts fused in the checkpoint (gate/up interleaved, [E, H, 2I]) with
biases, top-k logits then a softmax over the k, and the clamped SwiGLU (limit 0.5 here, so the clamps bite). A tiny
random model against transformers: fp32 prefill logits within the dense tests' 1e-4 and 24 greedy tokens identical
(9 + 24 positions, four windows' worth); bf16 weights: 24 greedy tokens identical to transformers in fp32 over them.
A batched decode of several sequences (the serve engine's slot caches, each with the sinks) is bit-identical to each
sequence's single run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from batch_decode_checks import batched_runs, compare, prompts, single_runs
from test_end_to_end import PROMPT, hf_greedy, hf_logits

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.testing import gguf_typed_gpt_oss, gpt_oss_20b_config

pytest.importorskip("tvm.relax")
NEW_TOKENS = 24


def test_spec_reads_gpt_oss():
    spec = ModelSpec.from_hf_config(gpt_oss_20b_config())
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.routing) == (32, 4, 2880, "topk_softmax")
    assert (moe.router_bias, moe.expert_bias, moe.expert_act, moe.swiglu_alpha, moe.swiglu_limit) == \
        (True, True, "swiglu_clamped", 1.702, 7.0)
    assert spec.qkv_bias and spec.o_bias and spec.attn_sinks and spec.head_dim * spec.num_heads != spec.hidden_size
    assert spec.sliding_window == 128 and spec.global_layers == tuple(range(1, 24, 2))
    assert spec.layer_window(0) == 128 and spec.layer_window(1) == 0
    assert (spec.rope.kind, spec.rope.factor, spec.rope.truncate) == ("yarn", 32.0, False)
    assert ModelSpec.from_json(spec.to_json()) == spec
    shapes = spec.block_weight_shapes(0)
    assert shapes["self_attn.sinks"] == (64,) and shapes["self_attn.o_proj.bias"] == (2880,)
    assert shapes["mlp.router.bias"] == (32,) and shapes["mlp.experts.31.down_proj.bias"] == (2880,)
    assert spec.post_attn_weight_names(0) == ("self_attn.o_proj.weight", "self_attn.o_proj.bias",
                                              "post_attention_layernorm.weight", "mlp.router.weight", "mlp.router.bias")
    # layer_types absent: transformers' default, every other block full
    assert ModelSpec.from_hf_config(gpt_oss_20b_config(layer_types=None)).global_layers == tuple(range(1, 24, 2))


@pytest.mark.parametrize("over,expected", [
    (dict(swiglu_limit=-1), "'swiglu_limit' expected a positive finite number"),
    (dict(num_local_experts=None), "'num_local_experts' expected a non-negative integer"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types expected 24 of"),
])
def test_bad_gpt_oss_config_is_one_line(over, expected):
    with pytest.raises(HelmcError, match=re.escape(expected)) as e:
        ModelSpec.from_hf_config(gpt_oss_20b_config(**over))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, host_hardware, cache_dir):
    """dtype -> (model directory, Session, transformers model in fp32 over the same weights); each built once."""
    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    cpu_only = dataclasses.replace(host_hardware, gpu=None, link=None)
    made = {}

    def get(dtype: str = "float32"):
        if dtype not in made:
            d = str(tmp_path_factory.mktemp(f"gpt_oss_{dtype}") / "model")
            ref = make_tiny_model(d, "gpt_oss", num_layers=4, dtype=dtype).float().eval()
            r = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True,
                          batch=4 if dtype == "float32" else 1)
            assert r.plan.placement.cpu_units == r.spec.num_units
            made[dtype] = (d, Session.load(r.bundle_dir), ref)
        return made[dtype]
    return get


def test_gpt_oss_matches_transformers(gpt_oss):
    d, s, ref = gpt_oss()
    spec = s.spec
    assert spec.global_layers == (1, 3) and spec.sliding_window == 8 and spec.attn_sinks and spec.o_bias
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"gpt-oss fp32: prefill logits max rel diff {rel:.3e}")
    assert ours.shape == theirs.shape and rel <= 1e-4
    s.reset()
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    assert s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens == expected
    assert len(set(expected)) > 4, "degenerate reference: the test would not catch a wrong model"
    ps = prompts(spec.vocab_size, 6)
    singles = single_runs(s, ps, 12)                     # prompts of up to 17 tokens + 12 steps: past the window
    batched, sizes = batched_runs(s, ps, 12, max_batch=4, stagger=1)
    assert {2, 3, 4} <= set(sizes), sizes
    compare(singles, batched, "gpt-oss fp32")


def test_gpt_oss_bf16_greedy_matches_transformers(gpt_oss):
    """bf16 weights (the published checkpoints' non-expert dtype): transformers in fp32 over the same bf16 values, as
    helmc's CPU stage keeps fp32 activations."""
    _, s, ref = gpt_oss("bfloat16")
    assert s.spec.dtype == "bfloat16"
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    assert s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens == expected
    assert len(set(expected)) > 4


def _config_dir(tmp_path) -> str:
    d = tmp_path / "gpt-oss-20b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(gpt_oss_20b_config()))
    return str(d)


def test_plans_use_the_gpu_where_there_is_one_and_the_cpu_alone_otherwise(tmp_path):
    """The GPU stage computes every part of a gpt-oss block (attention with its sinks, the biases, the biased,
    clamped experts): the planner places its blocks on a profile's GPU, and every unit on the CPU of a CPU-only
    profile; `helmc plan` says so in its JSON."""
    from click.testing import CliRunner

    from helmc.cli.main import main
    from helmc.hardware.profile import PRESET_DIR, HardwareProfile
    from helmc.planner.search_partition import plan
    with open(os.path.join(PRESET_DIR, "l40s-epyc.json")) as f:
        gpu = HardwareProfile.from_json(f.read())
    cpu = dataclasses.replace(gpu, gpu=None, link=None)
    spec = ModelSpec.from_hf_config(gpt_oss_20b_config())
    on_gpu = plan(spec, gpu)
    assert on_gpu.placement.uses_gpu and on_gpu.placement.cpu_units < spec.num_units
    own = plan(spec, cpu)
    assert own.placement.cpu_units == spec.num_units and not own.placement.uses_gpu
    d = _config_dir(tmp_path)
    for profile, want_gpu in ((cpu, False), (gpu, True)):
        hw = tmp_path / "hw.json"
        hw.write_text(profile.to_json())
        r = CliRunner().invoke(main, ["plan", d, str(hw), "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output[r.output.index("{"):])
        assert (out["gpu_units"] > 0) == want_gpu and out["cpu_units"] + out["gpu_units"] == spec.num_units, out


def test_fused_experts_read_as_each_experts_views_and_mxfp4_checkpoint_refused(tmp_path):
    """The checkpoint's fused experts read as each expert's gate / up (interleaved columns, transposed) and down with
    their biases, strided views of the mapping; a fused tensor of another shape, and the published MXFP4 layout
    (gate_up_proj_blocks / _scales), are one line each."""
    from safetensors.numpy import save_file

    from helmc.runtime.weights.safetensors_mmap import Checkpoint
    spec = ModelSpec.from_hf_config(gpt_oss_20b_config(hidden_size=8, intermediate_size=4, num_local_experts=3,
                                                       num_experts_per_tok=2, num_hidden_layers=2,
                                                       layer_types=None))
    rng = np.random.default_rng(0)
    t = {"model.layers.1.mlp.experts.gate_up_proj": rng.standard_normal((3, 8, 8), np.float32),
         "model.layers.1.mlp.experts.gate_up_proj_bias": rng.standard_normal((3, 8), np.float32),
         "model.layers.1.mlp.experts.down_proj": rng.standard_normal((3, 4, 8), np.float32),
         "model.layers.1.mlp.experts.down_proj_bias": rng.standard_normal((3, 8), np.float32)}
    save_file(t, str(tmp_path / "model.safetensors"))
    ck = Checkpoint.for_spec(str(tmp_path), spec)
    fused = t["model.layers.1.mlp.experts.gate_up_proj"]
    views = {k: ck.view(f"model.layers.1.mlp.experts.2.{k}") for k in
             ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_proj.bias", "up_proj.bias", "down_proj.bias")}
    assert np.array_equal(views["gate_proj.weight"], fused[2][:, 0::2].T) and views["gate_proj.weight"].shape == (4, 8)
    assert np.array_equal(views["up_proj.weight"], fused[2][:, 1::2].T)
    assert np.array_equal(views["down_proj.weight"], t["model.layers.1.mlp.experts.down_proj"][2].T)
    assert np.array_equal(views["up_proj.bias"], t["model.layers.1.mlp.experts.gate_up_proj_bias"][2, 1::2])
    assert np.array_equal(views["down_proj.bias"], t["model.layers.1.mlp.experts.down_proj_bias"][2])
    assert "model.layers.1.mlp.experts.gate_up_proj" not in ck.where and not views["gate_proj.weight"].flags.owndata
    ck.close()
    for bad, expected in (({"model.layers.0.mlp.experts.down_proj": np.zeros((3, 8, 4), np.float32)},
                           r"down_proj shape expected \[3, 4, 8\]"),
                          ({"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros((3, 8, 1, 16), np.uint8)},
                           "experts expected as floats .* found model.layers.0.mlp.experts.gate_up_proj_blocks")):
        save_file(bad, str(tmp_path / "model.safetensors"))
        with pytest.raises(HelmcError, match=expected) as e:
            Checkpoint.for_spec(str(tmp_path), spec)
        assert "\n" not in str(e.value)


def test_calibrate_measures_a_gpt_oss_bundle(gpt_oss, host_hardware, tmp_path):
    """helmc calibrate on a gpt-oss bundle: the CPU blocks timed with their sinks, the routing counted, the plan made
    again on the CPU; no one-call expert sum rate (float experts run through the compiled expert function)."""
    from helmc import api
    from helmc.runtime.bundle.plan import Plan
    d, s, _ = gpt_oss()
    hw_path = str(tmp_path / "hardware.json")
    dataclasses.replace(host_hardware, gpu=None, link=None).save(hw_path)
    result = api.calibrate(d + ".bundle", hw_path, steps=3)
    assert result.profile.cpu.expert_sum_reads == ()
    assert result.routing[1].startswith("plan made again from them: ")
    with open(os.path.join(d + ".bundle", "plan.json")) as f:
        assert Plan.from_json(f.read()).placement.cpu_units == s.spec.num_units
