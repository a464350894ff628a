"""Gemma 3 (Gemma3ForCausalLM) from a Hugging Face directory: RMSNorm as x * (1 + w), norms on the attention and
MLP outputs, GeGLU, embeddings times sqrt(hidden), attention scaled by query_pre_attn_scalar ** -0.5, and sliding
blocks (window 8, RoPE base 10000) beside a global one (base 1e6, linear scaling 8). A tiny random model with
head_dim 32 != hidden / heads against transformers: fp32 prefill logits within the dense tests' 1e-4 and 24 greedy
tokens identical (9 + 24 positions: three windows' worth, so a wrong window or RoPE table diverges); fp16 greedy
identical or, at the first divergence, each side's token in the other's top-5 (as the dense fp16 test). What is not
built is refused in one line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from test_end_to_end import PROMPT, hf_greedy, hf_logits

pytest.importorskip("tvm.relax")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from helmc.testing import make_tiny_model
    out = {}

    def model(dtype="float32"):
        if dtype not in out:
            d = str(tmp_path_factory.mktemp(f"gemma3_{dtype}") / "model")
            out[dtype] = (d, make_tiny_model(d, "gemma3", num_layers=4, dtype=dtype).float().eval())
        return out[dtype]
    return model


def _session(d, host_hardware, cache_dir):
    from helmc import api
    from helmc.runtime.session import Session
    cpu_only = dataclasses.replace(host_hardware, gpu=None, link=None)
    r = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    return r.spec, Session.load(r.bundle_dir)


def test_gemma3_matches_transformers(gemma3, host_hardware, cache_dir):
    d, ref = gemma3()
    spec, s = _session(d, host_hardware, cache_dir)
    assert spec.architecture == "Gemma3ForCausalLM" and spec.head_dim * spec.num_heads != spec.hidden_size
    assert spec.sliding_window == 8 and spec.global_layers == (2,) and spec.local_rope.theta == 10000.0
    assert (spec.rope.kind, spec.rope.factor, spec.attn_scale) == ("linear", 8.0, 24 ** -0.5)
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"gemma3: prefill logits max rel diff {rel:.3e}")
    assert ours.shape == theirs.shape and rel <= 1e-4
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, 24)
    assert got == expected and len(set(expected)) > 4
    s.reset()                      # the last position's logits, past three windows, as transformers gives them
    last, want = s.forward(PROMPT + expected, all_logits=True)[-1], hf_logits(ref, PROMPT + expected)[-1]
    assert np.abs(last - want).max() / np.abs(want).max() <= 1e-4


def test_gemma3_fp16_greedy_matches_or_top5(gemma3, host_hardware, cache_dir):
    d, ref32 = gemma3("float16")
    ref = ref32.half()
    _, s = _session(d, host_hardware, cache_dir)
    ours = s.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    theirs = hf_greedy(ref, PROMPT, 24)
    if ours != theirs:
        i = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        ctx = PROMPT + theirs[:i]
        their_top5 = np.argsort(-hf_logits(ref, ctx)[-1])[:5]
        s.reset()
        our_top5 = np.argsort(-s.forward(ctx)[-1])[:5]
        print(f"gemma3 fp16: first divergence at token {i}: helmc {ours[i]}, HF {theirs[i]}")
        assert ours[i] in their_top5 and theirs[i] in our_top5
    assert len(set(theirs)) > 4


def test_gemma3_config_of_older_transformers(gemma3, tmp_path):
    """config.json as Google's checkpoints carry it: rope_theta + rope_scaling for the global blocks,
    rope_local_base_freq for the sliding ones, sliding_window_pattern in place of layer_types."""
    from helmc.model.spec import ModelSpec
    cfg = json.load(open(os.path.join(gemma3()[0], "config.json")))
    for k in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        cfg.pop(k)
    cfg.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000,
               sliding_window_pattern=2, num_hidden_layers=6)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.global_layers == (1, 3, 5) and [spec.layer_window(i) for i in range(6)] == [8, 0] * 3
    assert (spec.rope.theta, spec.rope.kind, spec.rope.factor) == (1e6, "linear", 8.0)
    assert (spec.local_rope.theta, spec.local_rope.kind) == (10000.0, "default")
    assert [spec.layer_rope_local(i) for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("change, expected", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping expected null (no softcapping), found 30.0"),
    ({"hidden_activation": "relu"}, "hidden_activation expected one of ('silu', 'gelu_pytorch_tanh'), found 'relu'"),
    ({"layer_types": ["full_attention"]}, "layer_types expected 4 of ('sliding_attention', 'full_attention')"),
    ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar expected a positive number, found -1"),
])
def test_what_is_not_built_is_one_line(gemma3, tmp_path, change, expected):
    from helmc.errors import HelmcError
    from helmc.model.spec import ModelSpec
    d = str(tmp_path / "m")
    shutil.copytree(gemma3()[0], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.update(change)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(HelmcError) as e:
        ModelSpec.from_model_dir(d)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_quant_of_gemma3_is_refused_in_one_line(gemma3, tmp_path):
    from helmc.compiler.read_model import read_model
    from helmc.errors import HelmcError
    with pytest.raises(HelmcError, match="--quant: expected one of .*found "
                                         "Gemma3ForCausalLM \\(build it without --quant\\)$"):
        read_model(gemma3()[0], quant="q8_0", cache_dir=str(tmp_path))


def test_a_gpu_plan_for_gemma3_is_refused_in_one_line(gemma3):
    from helmc.compiler.pipeline import check_placement
    from helmc.errors import HelmcError
    from helmc.model.spec import ModelSpec
    from helmc.runtime.bundle.plan import Plan
    spec = ModelSpec.from_model_dir(gemma3()[0])
    with pytest.raises(HelmcError, match="plan: Gemma3ForCausalLM expected an all-CPU plan .* "
                                         "\\(helmc profile --gpu-backend none\\)$"):
        check_placement(spec, Plan(format_version=1, num_layers=4, cpu_units=2), None)
    check_placement(spec, Plan(format_version=1, num_layers=4, cpu_units=6), None)      # all on the CPU
