"""Phi-3 / Phi-4 (Phi3ForCausalLM) from a Hugging Face directory: q/k/v stored as one qkv_proj and gate/up as one
gate_up_proj. A tiny random model against transformers in fp32 (prefill logits within the dense tests' 1e-4, 24
greedy tokens identical); the fused weights read as zero-copy row ranges of the mapping (one copy in memory); what
is not built (longrope / su scaling, partial rotary, --quant through a phi3 GGUF) refused in one line.
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
def phi3(tmp_path_factory):
    from helmc.testing import make_tiny_model
    d = str(tmp_path_factory.mktemp("phi3") / "model")
    ref = make_tiny_model(d, "phi3")
    return d, ref.float().eval()


def test_phi3_matches_transformers(phi3, host_hardware, cache_dir):
    from helmc import api
    from helmc.runtime.session import Session
    d, ref = phi3
    cpu_only = dataclasses.replace(host_hardware, gpu=None, link=None)
    r = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    assert r.spec.architecture == "Phi3ForCausalLM" and r.spec.sliding_window == 0
    s = Session.load(r.bundle_dir)
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"phi3: prefill logits max rel diff {rel:.3e}")
    assert ours.shape == theirs.shape and rel <= 1e-4
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, 24)
    assert got == expected and len(set(expected)) > 4


def test_fused_weights_are_row_ranges_of_the_mapping(phi3):
    from helmc.model.spec import ModelSpec
    from helmc.runtime.weights.bind import check_checkpoint, open_checkpoint
    d, ref = phi3
    spec = ModelSpec.from_model_dir(d)
    ck = open_checkpoint(d, spec)
    try:
        check_checkpoint(ck, spec)
        assert "model.layers.0.self_attn.qkv_proj.weight" not in ck.where
        q, k, v = (ck.info(f"model.layers.1.self_attn.{n}_proj.weight") for n in "qkv")
        g, u = (ck.info(f"model.layers.1.mlp.{n}_proj.weight") for n in ("gate", "up"))
        assert (q.end, k.end) == (k.begin, v.begin) and g.end == u.begin      # back to back in the one tensor
        qkv = ref.model.layers[1].self_attn.qkv_proj.weight.detach().numpy()
        gate_up = ref.model.layers[1].mlp.gate_up_proj.weight.detach().numpy()
        view = ck.view("model.layers.1.self_attn.k_proj.weight")
        assert not view.flags.owndata and np.array_equal(view, qkv[spec.q_dim:spec.q_dim + spec.kv_dim])
        assert np.array_equal(ck.view("model.layers.1.mlp.up_proj.weight"), gate_up[spec.intermediate_size:])
    finally:
        ck.close()


@pytest.mark.parametrize("change, expected", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8}}, "rope type expected default, linear, llama3 or yarn, found 'longrope'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "rope partial_rotary_factor expected 1.0 (RoPE over the whole head), found 0.75"),
])
def test_what_is_not_built_is_one_line(phi3, tmp_path, change, expected):
    from helmc.errors import HelmcError
    from helmc.model.spec import ModelSpec
    d = str(tmp_path / "m")
    shutil.copytree(phi3[0], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.update(change)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(HelmcError, match="^[^\n]*$") as e:
        ModelSpec.from_model_dir(d)
    assert expected in str(e.value)


def test_quant_of_phi3_is_refused_in_one_line(phi3, tmp_path):
    from helmc.compiler.read_model import read_model
    from helmc.errors import HelmcError
    with pytest.raises(HelmcError, match="--quant: expected one of .*found "
                                         "Phi3ForCausalLM \\(build it without --quant\\)$"):
        read_model(phi3[0], quant="q8_0", cache_dir=str(tmp_path))


def test_fused_tensor_of_a_wrong_shape_is_one_line(phi3, tmp_path):
    from safetensors.numpy import load_file, save_file

    from helmc.errors import HelmcError
    from helmc.model.spec import ModelSpec
    from helmc.runtime.weights.bind import open_checkpoint
    d = str(tmp_path / "m")
    shutil.copytree(phi3[0], d)
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    t["model.layers.0.self_attn.qkv_proj.weight"] = t["model.layers.0.self_attn.qkv_proj.weight"][:-2]
    save_file(t, path)
    with pytest.raises(HelmcError, match=r"^weights: model.layers.0.self_attn.qkv_proj.weight shape expected \[128, "
                                         r"cols\] .* found \[126, 64\]$"):
        open_checkpoint(d, ModelSpec.from_model_dir(d))


def write_phi3_twin(model_dir: str, path: str, dtype=np.float32) -> None:
    """The HF directory as a `phi3` GGUF laid out as llama.cpp's converter writes it: attn_qkv and ffn_up (gate then
    up rows) fused, nothing permuted (NeoX RoPE), norms F32."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    from helmc.model.spec import ModelSpec
    spec = ModelSpec.from_model_dir(model_dir)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(spec.num_layers); w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size); w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads); w.add_head_count_kv(spec.num_kv_heads)
    w.add_rope_dimension_count(spec.head_dim); w.add_rope_freq_base(spec.rope.theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps); w.add_sliding_window(0)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("llama-bpe")
    w.add_token_list([f"t{i}" for i in range(spec.vocab_size)]); w.add_token_merges(["t 1"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, x in t.items():
        if name.startswith("model.layers."):
            layer, _, rest = name[len("model.layers."):].partition(".")
            g = f"blk.{layer}.{block[rest]}"
        else:
            g = names[name]
        w.add_tensor(g, np.ascontiguousarray(x, dtype=np.float32 if x.ndim == 1 else dtype))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_phi3_gguf_twin_is_the_hf_model_exactly(phi3, host_hardware, cache_dir, tmp_path):
    from helmc import api
    from helmc.runtime.session import Session
    d, _ = phi3
    cpu_only = dataclasses.replace(host_hardware, gpu=None, link=None)
    path = str(tmp_path / "phi3.gguf")
    write_phi3_twin(d, path)
    a = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert b.spec.architecture == "Phi3ForCausalLM" and b.spec.q_dim == a.spec.q_dim
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4
    # q/k/v and gate/up are row ranges of the file's fused tensors, not copies
    q, v = sb.checkpoint.info("model.layers.1.self_attn.q_proj.weight"), sb.checkpoint.info("model.layers.1.self_attn.v_proj.weight")
    g, u = sb.checkpoint.info("model.layers.1.mlp.gate_proj.weight"), sb.checkpoint.info("model.layers.1.mlp.up_proj.weight")
    assert (q.gguf_name, v.offset) == ("blk.1.attn_q.weight", q.offset + q.nbytes + v.nbytes)
    assert u.offset == g.offset + g.nbytes


def test_phi3_gguf_with_longrope_factors_is_one_line(phi3, tmp_path):
    gguf = pytest.importorskip("gguf")
    from helmc.errors import HelmcError
    from helmc.model.gguf_spec import read_gguf_spec
    path = str(tmp_path / "long.gguf")
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32); w.add_feed_forward_length(32)
    w.add_head_count(2); w.add_head_count_kv(2); w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float16))
    w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32))
    w.add_tensor("rope_factors_short.weight", np.ones(8, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(HelmcError, match=r"^[^\n]*RoPE scaling expected none or linear, found longrope[^\n]*$"):
        read_gguf_spec(path)


def test_phi3_sliding_window_matches_transformers(host_hardware, cache_dir, tmp_path):
    """config.json's sliding_window (Phi-3-mini's 2047) as transformers applies it: a window of 6 over a 9-token
    prompt and 16 more."""
    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    d = str(tmp_path / "swa")
    ref = make_tiny_model(d, "phi3", sliding_window=6).float().eval()
    cpu_only = dataclasses.replace(host_hardware, gpu=None, link=None)
    r = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    assert r.spec.sliding_window == 6
    s = Session.load(r.bundle_dir)
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
    s.reset()
    expected = hf_greedy(ref, PROMPT, 16)
    assert s.generate(prompt_ids=PROMPT, max_new_tokens=16, stop_at_eos=False).tokens == expected
