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

    def model(dtype="float32", scalar=24):
        if (dtype, scalar) not in out:
            d = str(tmp_path_factory.mktemp(f"gemma3_{dtype}_{scalar}") / "model")
            out[dtype, scalar] = (d, make_tiny_model(d, "gemma3", num_layers=4, dtype=dtype,
                                                     query_pre_attn_scalar=scalar).float().eval())
        return out[dtype, scalar]
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


def test_gemma3_sliding_pages_freed_over_a_long_context(gemma3, host_hardware, cache_dir):
    """Pages of 4 tokens, a 30-token prompt and 24 greedy tokens (~7 windows of 8): the sliding blocks' pages leave
    the CPU cache as the window passes them, the global block keeps all of its, and the tokens and every position's
    logits are still transformers'."""
    from helmc import api
    from helmc.runtime.session import Session
    d, ref = gemma3()
    r = api.build(d, dataclasses.replace(host_hardware, gpu=None, link=None), d + ".bundle", cache_dir=cache_dir,
                  quiet=True)
    s = Session.load(r.bundle_dir, kv_page_tokens=4)
    prompt = PROMPT + [int(t) for t in np.random.default_rng(4).integers(3, 500, 21)]
    got = s.generate(prompt_ids=prompt, max_new_tokens=24, stop_at_eos=False).tokens
    assert got == hf_greedy(ref, prompt, 24) and len(set(got)) > 4
    kv = s.cpu_stage.kv
    sliding, full = kv.kind_pages(0), kv.kind_pages(2)
    assert sliding.layers == (0, 1, 3) and full.layers == (2,)
    n = kv.length
    assert n >= 53 and sliding.table(0).first_page == (n + 1 - 8) // 4 >= 11
    assert sliding.table(0).n_pages <= 3 and sliding.pool.host_free >= sliding.pool.host_capacity - 3
    assert full.table(0).first_page == 0 and full.table(0).n_pages == -(-n // 4)
    s.reset()
    ours, theirs = s.forward(prompt + got, all_logits=True), hf_logits(ref, prompt + got)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"gemma3, 4-token pages, {len(prompt + got)} positions: logits max rel diff {rel:.3e}")
    assert rel <= 1e-4 and sliding.table(0).first_page == (len(prompt + got) + 1 - 8) // 4


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


def test_gemma3_plans_may_stream_prefill_and_decode_hybrid(gemma3):
    """Gemma 3's streamed and staged blocks take their own windows and RoPE tables (ModelSpec.layer_window,
    runtime/rope.block_rope), so plans with the prefill streamed to the GPU or with hybrid decode groups are
    carried out at build (check_placement) and accepted at load (check_plan), a global block among the streamed
    ones included; the GPU cache's layers (streamed blocks first, then the resident ones) carry their blocks'
    windows."""
    from helmc.compiler.pipeline import check_placement
    from helmc.hardware.profile import load_hardware
    from helmc.model.spec import ModelSpec
    from helmc.planner.hybrid import forced_layout, forced_split
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.bundle.plan_check import check_plan
    from helmc.runtime.gpu_session import gpu_cache_layers, gpu_cache_windows
    spec = ModelSpec.from_model_dir(gemma3()[0])
    assert [spec.layer_window(i) for i in range(4)] == [8, 8, 0, 8]
    hw = load_hardware("h100-sxm-measured")
    base = Plan.of(num_layers=4, cpu_units=0, max_context=512, prefill_chunk_tokens=16, gpu_kv_pool_bytes=64 << 20)
    streamed = forced_split(base, spec, 3)                 # blocks 0, 1 on the host, their prefill on the GPU
    hybrid = forced_layout(base, spec, ((1, 2),))          # C0 [0] S0 [1, 2] | resident [3]: block 2 global
    assert streamed.placement.prefill_on_gpu and hybrid.placement.streamed_layers == (1, 2)
    for p in (streamed, hybrid):
        check_placement(spec, p, hw)
        check_plan(p, spec, p)
        check_plan(p, spec, base, where="--plan")
    assert gpu_cache_layers(hybrid.placement) == (1, 2, 3) and gpu_cache_windows(spec, hybrid.placement) == (8, 0, 8)
    assert gpu_cache_windows(spec, streamed.placement) == (0, 8)                 # resident blocks 2, 3


_GEMMA3_GGUF_BLOCK = {   # llama.cpp's gemma3 names (gguf-py MODEL_ARCH.GEMMA3), spelled out apart from helmc's table
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight"}


def write_gemma3_twin(model_dir: str, path: str, pattern=None) -> None:
    """The HF directory as a `gemma3` GGUF laid out as llama.cpp's converter writes it: every norm weight stored
    as w + 1 in F32, nothing permuted, no output.weight (tied), the global RoPE's linear scaling, the sliding
    window; `pattern`: {arch}.attention.sliding_window_pattern (default: the model's layer_types as booleans)."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(cfg["num_hidden_layers"]); w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"]); w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"]); w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"]); w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"]); w.add_sliding_window(cfg["sliding_window"])
    full = cfg["rope_parameters"]["full_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR); w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window_pattern([k == "sliding_attention" for k in cfg["layer_types"]] if pattern is None
                                 else pattern)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])]); w.add_token_merges(["t 1"])
    for name, x in t.items():
        if name.startswith("model.layers."):
            layer, _, rest = name[len("model.layers."):].partition(".")
            g = f"blk.{layer}.{_GEMMA3_GGUF_BLOCK[rest]}"
        else:
            g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        x = np.asarray(x, np.float32)
        w.add_tensor(g, np.ascontiguousarray(x + np.float32(1.0) if name.endswith("norm.weight") else x))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_gemma3_gguf_twin_is_the_hf_model_exactly(gemma3, host_hardware, cache_dir, tmp_path):
    from helmc import api
    from helmc.runtime.session import Session
    d, _ = gemma3(scalar=32)      # llama.cpp scales by head_dim ** -0.5 (the 27B's hidden / heads): no key for it
    cpu_only = dataclasses.replace(host_hardware, gpu=None, link=None)
    path = str(tmp_path / "gemma3.gguf")
    write_gemma3_twin(d, path)
    a = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert b.spec.architecture == "Gemma3ForCausalLM" and b.spec.norm_offset == 0.0 and a.spec.norm_offset == 1.0
    assert b.spec.attn_scale == a.spec.attn_scale == 32 ** -0.5
    assert (b.spec.global_layers, b.spec.sliding_window, b.spec.local_rope, b.spec.rope) == \
        (a.spec.global_layers, a.spec.sliding_window, a.spec.local_rope, a.spec.rope)
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4
    info = sb.checkpoint.info("model.layers.0.post_attention_layernorm.weight")
    assert info.gguf_name == "blk.0.post_attention_norm.weight"


@pytest.mark.parametrize("pattern, global_layers", [(3, (2,)), (6, ()), ([True, False, True, True], (1,))])
def test_gemma3_gguf_sliding_window_pattern(gemma3, tmp_path, pattern, global_layers):
    from helmc.model.gguf_spec import read_gguf_spec
    path = str(tmp_path / "g.gguf")
    write_gemma3_twin(gemma3()[0], path, pattern)
    spec = read_gguf_spec(path)
    assert spec.global_layers == global_layers and spec.attn_scale == 32 ** -0.5
    assert (spec.local_rope.theta, spec.embed_scale, spec.hidden_act) == (10000.0, 8.0, "gelu_pytorch_tanh")


def test_gemma3_gguf_bad_pattern_is_one_line(gemma3, tmp_path):
    from helmc.errors import HelmcError
    from helmc.model.gguf_spec import read_gguf_spec
    path = str(tmp_path / "g.gguf")
    write_gemma3_twin(gemma3()[0], path, [True, False])
    with pytest.raises(HelmcError, match=r"gemma3.attention.sliding_window_pattern expected a positive integer or "
                                         r"4 booleans, found \[True, False\]$"):
        read_gguf_spec(path)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_scaled_embedding_rows_are_transformers_bits(tmp_path, dtype):
    """Embedding rows times sqrt(hidden), rounded in the checkpoint's dtype as Gemma3TextScaledWordEmbedding does."""
    import torch
    from helmc.model.spec import ModelSpec
    from helmc.runtime.weights.bind import Embedding, open_checkpoint
    from helmc.testing import make_tiny_model
    d = str(tmp_path / "m")
    ref = make_tiny_model(d, "gemma3", num_layers=1, dtype=dtype, hidden_size=48)   # sqrt(48): products round
    spec = ModelSpec.from_model_dir(d)
    ck = open_checkpoint(d, spec)
    try:
        ids = np.array(PROMPT, dtype=np.int64)
        with torch.no_grad():
            want = ref.model.embed_tokens(torch.from_numpy(ids)).float().numpy()
        got = Embedding(ck, spec)(ids)
        assert spec.embed_scale == 48 ** 0.5 and got.dtype == np.float32 and np.array_equal(got, want)
        if dtype != "float32":        # rounded in the weights' dtype, not kept in fp32
            rows = ref.model.embed_tokens.weight.detach()[torch.from_numpy(ids)].float().numpy()
            assert not np.array_equal(got, rows * np.float32(48 ** 0.5))
    finally:
        ck.close()
