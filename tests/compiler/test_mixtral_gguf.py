"""Mixtral from GGUF files and quantized: a tiny random MixtralForCausalLM in its real structure (8 experts, top-2,
the router's softmax then top-k renormalised, no q/k norm, every block routed; hidden 256 and expert ffn 256: whole
K-quant blocks).

llama.cpp writes Mixtral as general.architecture `llama` with experts (llama.expert_count, expert_used_count, the
router ffn_gate_inp, the experts stacked per kind in ffn_{gate,up,down}_exps, q/k rows permuted per head as for any
llama file, no expert_feed_forward_length: the experts are feed_forward_length wide). helmc reads such a file as
Mixtral; a llama file without experts stays Llama.

- An F16 GGUF twin of the fp16 HF directory, written here with the gguf package as llama.cpp's converter lays it
  out: built from the file, its logits and 24 greedy tokens equal the HF directory's bundle's exactly.
- `--quant q8_0 | q4_k` of the HF directory (helmc writes that llama-with-experts file) against transformers in
  fp32 on the weights dequantized by the gguf package's own code: the dense quantized tests' rule; q4_k_m's mix read
  back from the file it writes.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from test_quantized_models import INT8_EXPERT_PREFILL_TOL, PROMPT, compare

gguf = pytest.importorskip("gguf")

from helmc.errors import HelmcError  # noqa: E402

DIMS = dict(num_layers=3, head_dim=64, hidden_size=256, intermediate_size=256)


@pytest.fixture(scope="module")
def cpu_only(host_hardware):
    return dataclasses.replace(host_hardware, gpu=None, link=None)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    from helmc.testing import make_tiny_model
    d = str(tmp_path_factory.mktemp("mixtral-k") / "model")
    make_tiny_model(d, "mixtral", dtype="float16", seed=3, **DIMS)
    return d


def _llama_keys(w, spec, experts: bool = True) -> None:
    """The llama keys llama.cpp's converter writes for a Mixtral config (expert_feed_forward_length it does not)."""
    w.add_block_count(spec.num_layers); w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size); w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads); w.add_head_count_kv(spec.num_kv_heads)
    w.add_rope_freq_base(spec.rope.theta); w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size); w.add_rope_dimension_count(spec.head_dim)
    if experts:
        w.add_expert_count(spec.moe.num_experts); w.add_expert_used_count(spec.moe.top_k)


def write_f16_twin(model_dir: str, path: str) -> None:
    """The fp16 HF directory as an F16 `llama` GGUF with experts: llama.cpp's names, q/k rows permuted per head,
    the experts stacked [E, rows, cols], the router and norms F32."""
    from safetensors.numpy import load_file

    from helmc.model.gguf_spec import qk_rows_to_gguf
    from helmc.model.spec import ModelSpec
    spec = ModelSpec.from_model_dir(model_dir)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "llama")
    _llama_keys(w, spec)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("llama-bpe")
    w.add_token_list([f"t{i}" for i in range(spec.vocab_size)]); w.add_token_merges(["t 1"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
    stacked = {}
    for name, x in t.items():
        parts = name.split(".")
        if ".experts." in name:                   # model.layers.N.block_sparse_moe.experts.E.w1.weight
            stacked.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = x
            continue
        if name in names:
            w.add_tensor(names[name], x)
            continue
        local = ".".join(parts[3:])
        if local in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):   # llama.cpp's per-head permutation
            heads = spec.num_heads if "q_proj" in local else spec.num_kv_heads
            x = x[qk_rows_to_gguf(heads, spec.head_dim)]
        x = x.astype(np.float32) if x.ndim == 1 or local == "block_sparse_moe.gate.weight" else x
        w.add_tensor(f"blk.{parts[2]}.{block[local]}", np.ascontiguousarray(x))
    for (layer, kind), experts in sorted(stacked.items()):
        stem = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}[kind]
        w.add_tensor(f"blk.{layer}.{stem}.weight", np.stack([experts[e] for e in sorted(experts)]))   # [E, rows, cols]
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_llama_file_with_experts_reads_as_mixtral(mixtral_dir, tmp_path):
    from helmc.model.gguf_spec import gguf_name, hf_name, read_gguf_spec
    from helmc.model.spec import ModelSpec
    path = str(tmp_path / "twin.gguf")
    write_f16_twin(mixtral_dir, path)
    spec, hf = read_gguf_spec(path), ModelSpec.from_model_dir(mixtral_dir)
    assert spec.architecture == "MixtralForCausalLM" and spec.moe == hf.moe and spec.moe.naming == "mixtral"
    assert (spec.qk_norm, spec.moe.expert_intermediate_size, spec.moe.dense_layers) == (False, 256, ())
    for name in ("model.layers.2.block_sparse_moe.experts.7.w2.weight", "model.layers.0.block_sparse_moe.gate.weight"):
        assert hf_name(gguf_name(name), "mixtral") == name
    assert gguf_name("model.layers.1.block_sparse_moe.experts.3.w3.weight") == "blk.1.ffn_up_exps.3.weight"
    assert hf_name("blk.1.ffn_up_exps.3.weight") == "model.layers.1.mlp.experts.3.up_proj.weight"   # Qwen3-MoE's


def test_llama_file_without_experts_stays_llama_and_experts_need_their_count(tmp_path):
    from helmc.model.gguf_spec import read_gguf_spec
    from helmc.model.spec import ModelSpec
    from helmc.testing import tiny_config
    cfg = tiny_config("mixtral", num_layers=1, head_dim=16)
    cfg.architectures = ["MixtralForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    for experts, expected in ((False, "LlamaForCausalLM"), (True, "required key 'llama.expert_count' missing")):
        path = str(tmp_path / f"{experts}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        _llama_keys(w, spec, experts=False)
        w.add_tensor("token_embd.weight", np.zeros((spec.vocab_size, spec.hidden_size), np.float16))
        if experts:                       # a router but no llama.expert_count: Mixtral's file, missing its key
            w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((8, spec.hidden_size), np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        if not experts:
            from helmc.model.gguf_spec import read_gguf_header, spec_from_gguf_header
            assert spec_from_gguf_header(read_gguf_header(path)).architecture == expected
            continue
        with pytest.raises(HelmcError, match=expected) as e:
            read_gguf_spec(path)
        assert "\n" not in str(e.value)


def test_f16_gguf_twin_is_the_hf_model_exactly(mixtral_dir, cpu_only, cache_dir, tmp_path):
    pytest.importorskip("tvm.relax")
    from helmc import api
    from helmc.runtime.session import Session
    path = str(tmp_path / "twin.gguf")
    write_f16_twin(mixtral_dir, path)
    a = api.build(mixtral_dir, cpu_only, str(tmp_path / "hf.bundle"), cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert b.spec.architecture == "MixtralForCausalLM" and b.spec.moe == a.spec.moe
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4
    # each expert of the file is a view of the mapping (no copy of the stacked tensor)
    info = sb.checkpoint.info("model.layers.2.block_sparse_moe.experts.7.w2.weight")
    first = sb.checkpoint.info("model.layers.2.block_sparse_moe.experts.0.w2.weight")
    assert info.gguf_name == "blk.2.ffn_down_exps.7.weight" and info.offset == first.offset + 7 * first.nbytes


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_quantized_mixtral_matches_transformers(quant, mixtral_dir, cpu_only, cache_dir):
    """q8_0's experts run as GEMVs of their own, q4_k's through the one-call int8 expert sums (one expert signature:
    every block's experts q4_k). Two signatures in one build, q4_k_m's, are Qwen3-MoE's q4_k_m build's
    (tests/compiler/test_moe_gguf.py, the same expert shapes and kernels; each signature's kernels compile for
    ~40 s on 2 cores); Mixtral's q4_k_m mix is read back in test_q4_k_m_mix_of_mixtral_reads_back."""
    pytest.importorskip("tvm.relax")
    from helmc import api
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.model.gguf_spec import read_gguf_header
    from helmc.runtime.moe_experts import find_expert_sums
    from helmc.runtime.session import Session
    from helmc.schedules.cpu.isa import select_isa
    from helmc.testing import hf_on_dequantized_weights
    r = api.build(mixtral_dir, cpu_only, mixtral_dir + f"-{quant}.bundle", cache_dir=cache_dir, quiet=True,
                  quant=quant)
    spec = r.spec
    assert spec.architecture == "MixtralForCausalLM" and spec.moe.naming == "mixtral"
    assert spec.expert_types == ((quant,) * 3,) * 3 and len(spec.expert_signatures()) == 1
    if quant == "q4_k":       # for 8 experts llama.cpp's K mixes put attn_k / attn_v in q8_0, attn_output in q5_k
        assert spec.layer_types[0] == ("q4_k", "q8_0", "q8_0", "q5_k", "", "", "")
    path = quantize_checkpoint(mixtral_dir, quant, os.path.join(cache_dir, "weights"))
    h = read_gguf_header(path)                    # written as llama.cpp writes Mixtral: llama with experts
    assert h.architecture == "llama" and h.metadata["llama.expert_count"] == 8
    assert h.tensors["blk.0.ffn_gate_inp.weight"].type == "f32"
    session = Session.load(r.bundle_dir)
    if quant == "q4_k" and select_isa(cpu_only.cpu.features).tier == "avx512":
        assert sorted(find_expert_sums(session.cpu_stage.vm, spec)) == [0]     # the one-call sums, one signature
    compare(session, hf_on_dequantized_weights(mixtral_dir, path), f"mixtral --quant {quant}",
            prefill_tol=INT8_EXPERT_PREFILL_TOL if quant == "q4_k" else 1e-2)


def test_q4_k_m_mix_of_mixtral_reads_back(mixtral_dir, tmp_path):
    """--quant q4_k_m of the Mixtral directory (no compile): llama.cpp's mix, ffn_down of the more-bits blocks
    (block 2 of 3) in q6_k, the experts' too, so two expert signatures; for 8 experts attn_k / attn_v in q8_0 and
    attn_output in q5_k (q, k, v, o; no dense MLP); written as a llama file with experts."""
    from helmc.compiler.read_model import read_model
    from helmc.model.gguf_spec import read_gguf_header
    source = read_model(mixtral_dir, "q4_k_m", str(tmp_path / "cache"))
    spec = source.spec
    assert spec.architecture == "MixtralForCausalLM" and spec.moe.naming == "mixtral"
    assert spec.expert_types == (("q4_k",) * 3, ("q4_k",) * 3, ("q4_k", "q4_k", "q6_k"))
    assert len(spec.expert_signatures()) == 2
    assert spec.layer_types[0] == ("q4_k", "q8_0", "q8_0", "q5_k", "", "", "")
    h = read_gguf_header(source.weights)
    assert h.architecture == "llama" and h.metadata["llama.expert_count"] == 8
    for block, down in ((0, "q4_k"), (2, "q6_k")):       # the file's types, each expert a view of its stack
        assert {h.tensors[f"blk.{block}.ffn_down_exps.{e}.weight"].type for e in range(8)} == {down}, block


def test_quant_reads_back_as_mixtral_with_its_types(tmp_path):
    """--quant of a Mixtral directory (no compile): the file helmc writes reads back as the same Mixtral (its
    sliding window too), every expert in the mix's type."""
    from helmc.compiler.read_model import read_model
    from helmc.model.spec import ModelSpec
    from helmc.testing import make_tiny_model
    d = str(tmp_path / "model")
    make_tiny_model(d, "mixtral", num_layers=2, head_dim=64, hidden_size=256, intermediate_size=256)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:       # a window, which the file must carry too
        json.dump({**config, "sliding_window": 128}, f)
    source = read_model(d, "q8_0", str(tmp_path / "cache"))
    hf = ModelSpec.from_model_dir(d)
    assert hf.sliding_window == source.spec.sliding_window == 128
    assert source.weights.endswith(".gguf") and source.spec.architecture == "MixtralForCausalLM"
    assert source.spec.moe == hf.moe and source.spec.expert_types == (("q8_0",) * 3,) * 2
    assert source.spec.layer_types[0] == ("q8_0",) * 4 + ("",) * 3      # attention's linears; no dense MLP
