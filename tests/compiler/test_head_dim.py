"""Mistral-Nemo-style shapes: config.json's head_dim is not hidden_size / num_attention_heads (Nemo: hidden 5120,
32 heads of 128, so q is 4096 wide and o_proj maps 4096 back to 5120). A tiny random MistralForCausalLM of that
kind (hidden 128, 4 heads of 16, 2 KV heads: q 64 wide, k/v 32) against transformers in fp32, and its F32 `llama`
GGUF twin, written here with the gguf package as llama.cpp's converter lays it out (q/k rows permuted per head,
`llama.attention.key_length` 16), read back to the same logits and tokens.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from test_end_to_end import PROMPT, hf_greedy, hf_logits

gguf = pytest.importorskip("gguf")
pytest.importorskip("tvm.relax")

NEMO_DIMS = dict(hidden_size=128, head_dim=16)   # 4 heads x 16 = 64 != 128


@pytest.fixture(scope="module")
def cpu_only(host_hardware):
    return dataclasses.replace(host_hardware, gpu=None, link=None)


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    from helmc.testing import make_tiny_model
    d = str(tmp_path_factory.mktemp("nemo") / "model")
    ref = make_tiny_model(d, "mistral", **NEMO_DIMS)
    return d, ref.float().eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: each head's rotary halves interleaved
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_twin(model_dir: str, path: str) -> None:
    from safetensors.numpy import load_file

    from helmc.model.gguf_spec import gguf_name
    from helmc.model.spec import ModelSpec
    spec = ModelSpec.from_model_dir(model_dir)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(spec.num_layers); w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size); w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads); w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim); w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim); w.add_vocab_size(spec.vocab_size)
    w.add_rope_freq_base(spec.rope.theta); w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("llama-bpe")
    w.add_token_list([f"t{i}" for i in range(spec.vocab_size)]); w.add_token_merges(["t 1"])
    for name, x in t.items():
        if name.endswith("self_attn.q_proj.weight"):
            x = _permute(x, spec.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            x = _permute(x, spec.num_kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_head_dim_apart_from_hidden_matches_transformers(nemo, cpu_only, cache_dir):
    from helmc import api
    from helmc.runtime.session import Session
    d, ref = nemo
    r = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    assert (r.spec.head_dim, r.spec.q_dim, r.spec.kv_dim, r.spec.hidden_size) == (16, 64, 32, 128)
    s = Session.load(r.bundle_dir)
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"mistral head_dim 16 x 4 heads, hidden 128: prefill logits max rel diff {rel:.3e}")
    assert ours.shape == theirs.shape and rel <= 1e-4
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, 24)
    assert got == expected and len(set(expected)) > 4


def test_llama_gguf_with_key_length_is_the_hf_model_exactly(nemo, cpu_only, cache_dir, tmp_path):
    from helmc import api
    from helmc.runtime.session import Session
    d, _ = nemo
    path = str(tmp_path / "nemo.gguf")
    write_llama_twin(d, path)
    a = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert b.spec.architecture == "LlamaForCausalLM"
    assert (b.spec.head_dim, b.spec.q_dim, b.spec.hidden_size) == (16, 64, 128)
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4


def test_quantized_file_keeps_the_head_dim(nemo, tmp_path):
    """--quant writes the llama file with key_length / value_length / rope.dimension_count = head_dim and q/k
    permuted by heads of head_dim rows: it reads back as the same shapes, and q's rows back in HF order."""
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.model.gguf_spec import read_gguf_spec
    from helmc.runtime.weights.gguf_mmap import GGUFCheckpoint
    d, ref = nemo
    path = quantize_checkpoint(d, "q8_0", str(tmp_path))
    spec = read_gguf_spec(path)
    assert (spec.head_dim, spec.q_dim, spec.kv_dim, spec.hidden_size) == (16, 64, 32, 128)
    ck = GGUFCheckpoint(path)
    try:
        w = gguf.quants.dequantize(np.ascontiguousarray(ck.raw_hf("model.layers.0.self_attn.q_proj.weight")),
                                   gguf.GGMLQuantizationType.Q8_0).reshape(64, 128)
    finally:
        ck.close()
    expected = ref.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert np.abs(w - expected).max() < 0.01 * np.abs(expected).max()
