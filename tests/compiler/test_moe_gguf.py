"""Mixture of experts from GGUF files and quantized: a tiny random Qwen3MoeForCausalLM (8 experts, top-2, normalised
top-k, 3 blocks of which block 1 is dense; hidden 256 and expert ffn 256: whole K-quant blocks).

- `--quant q8_0 | q4_k_m` of the HF directory (helmc writes a `qwen3moe` GGUF with the experts stacked per kind,
  as llama.cpp does) against transformers in fp32 on the weights dequantized by the gguf package's own code:
  prefill logits within 1e-2 relative, 16 greedy tokens identical or each side's token in the other's top 5 at
  the first divergence (the dense quantized tests' rule).
- An F16 GGUF twin of the fp16 HF directory, written here with the gguf package as llama.cpp's converter lays it
  out: built from the file, its 24 greedy tokens and its logits equal the HF directory's bundle's exactly.
- The stacked expert tensors bind zero-copy: each expert's weights are a view into the mapping.
- A q4_k_m build served in batches: the decode steps of 2-4 sequences run each block's experts of every row in one
  call (schedules/cpu/quant/moe_experts_rows.py) and every sequence's logits equal its single run's, every bit.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from test_quantized_models import INT8_EXPERT_PREFILL_TOL, PROMPT, compare

gguf = pytest.importorskip("gguf")
pytest.importorskip("tvm.relax")

from helmc.runtime.moe_experts import LayerExperts, find_expert_sums  # noqa: E402
from helmc.schedules.cpu.isa import select_isa  # noqa: E402

DIMS = dict(num_layers=3, head_dim=64, hidden_size=256, moe_intermediate_size=256)


@pytest.fixture(scope="module")
def cpu_only(host_hardware):
    return dataclasses.replace(host_hardware, gpu=None, link=None)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helmc.testing import make_tiny_model
    d = str(tmp_path_factory.mktemp("moe-k") / "model")
    make_tiny_model(d, "qwen3_moe", dtype="float16", **DIMS)
    return d


def write_f16_twin(model_dir: str, path: str) -> None:
    """The fp16 HF directory as an F16 `qwen3moe` GGUF: llama.cpp's names, the experts stacked [E, rows, cols],
    the router and norms F32."""
    from safetensors.numpy import load_file

    from helmc.model.gguf_spec import gguf_name
    from helmc.model.spec import ModelSpec
    spec = ModelSpec.from_model_dir(model_dir)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(spec.num_layers); w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size); w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads); w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim); w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope.theta); w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_expert_count(spec.moe.num_experts); w.add_expert_used_count(spec.moe.top_k)
    w.add_expert_feed_forward_length(spec.moe.expert_intermediate_size)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(spec.vocab_size)]); w.add_token_merges(["t 1"])
    stacked = {}
    for name, x in t.items():
        if ".experts." in name:                   # model.layers.N.mlp.experts.E.gate_proj.weight
            parts = name.split(".")
            stacked.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = x
            continue
        x = x.astype(np.float32) if x.ndim == 1 or name.endswith("mlp.gate.weight") else x
        w.add_tensor(gguf_name(name), x)
    for (layer, kind), experts in sorted(stacked.items()):
        stem = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[kind]
        w.add_tensor(f"blk.{layer}.{stem}.weight", np.stack([experts[e] for e in sorted(experts)]))   # [E, rows, cols]
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_f16_gguf_twin_is_the_hf_model_exactly(moe_dir, cpu_only, cache_dir, tmp_path):
    from helmc import api
    from helmc.runtime.session import Session
    path = str(tmp_path / "twin.gguf")
    write_f16_twin(moe_dir, path)
    a = api.build(moe_dir, cpu_only, str(tmp_path / "hf.bundle"), cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert b.spec.moe == dataclasses.replace(a.spec.moe) and b.spec.moe.dense_layers == (1,)
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4
    # each expert of the file is a view of the mapping (no copy of the stacked tensor)
    info = sb.checkpoint.info("model.layers.2.mlp.experts.7.down_proj.weight")
    first = sb.checkpoint.info("model.layers.2.mlp.experts.0.down_proj.weight")
    assert info.gguf_name == "blk.2.ffn_down_exps.7.weight" and info.offset == first.offset + 7 * first.nbytes


def _build(moe_dir, cpu_only, cache_dir, quant):
    """The --quant build of the module's model. q4_k_m's is built for batches of up to 4 sequences, once for the
    tests that run it (the artifact cache): a single sequence on it runs the one-row expert sums and its prompts the
    m-row ones in chunks, as on a one-sequence build, and test_q4_k_m_batched_steps_equal_single_runs runs its
    batched steps (each q4_k_m build compiles both expert signatures' kernels: ~80 s on 2 cores)."""
    from helmc import api
    if quant == "q4_k_m":
        return api.build(moe_dir, cpu_only, moe_dir + "-q4_k_m-b4.bundle", cache_dir=cache_dir, quiet=True,
                         quant="q4_k_m", batch=4)
    return api.build(moe_dir, cpu_only, moe_dir + f"-{quant}.bundle", cache_dir=cache_dir, quiet=True, quant=quant)


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_quantized_experts_match_transformers(quant, moe_dir, cpu_only, cache_dir):
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.runtime.session import Session
    from helmc.testing import hf_on_dequantized_weights
    r = _build(moe_dir, cpu_only, cache_dir, quant)
    spec = r.spec
    base = {"q8_0": "q8_0", "q4_k_m": "q4_k"}[quant]
    assert spec.expert_types[0][:2] == (base, base) and spec.expert_types[1] == ("", "", "")   # block 1 is dense
    if quant == "q4_k_m":     # llama.cpp's mix: ffn_down of the more-bits blocks (block 2 of 3) in q6_k, experts' too
        assert (spec.expert_types[0][2], spec.expert_types[2][2]) == ("q4_k", "q6_k")
        assert len(spec.expert_signatures()) == 2        # two compiled expert functions
    path = quantize_checkpoint(moe_dir, quant, os.path.join(cache_dir, "weights"))
    session = Session.load(r.bundle_dir)
    if quant == "q4_k_m" and select_isa(cpu_only.cpu.features).tier == "avx512":
        # decode runs each block's experts in one call (schedules/cpu/quant/moe_experts.py) over stacked weights
        assert sorted(find_expert_sums(session.cpu_stage.vm, spec)) == [0, 1]
        assert all(b.post[-1].stacked is not None for b in session.cpu_stage.bindings if b.post[-1].__class__
                   is LayerExperts)
    compare(session, hf_on_dequantized_weights(moe_dir, path), f"qwen3_moe --quant {quant}",
            prefill_tol=INT8_EXPERT_PREFILL_TOL if quant == "q4_k_m" else 1e-2)



def test_prompt_experts_are_the_one_row_sums_in_chunks(moe_dir, cpu_only, cache_dir):
    """A prompt's quantized experts on the CPU stage run through the m-row expert sum, ROWS_PER_CALL rows a call:
    every row bit-identical to the one-row kernel on that row alone (what a decode step computes), across the chunk
    boundaries."""
    from helmc.runtime import moe_experts
    from helmc.runtime.session import Session
    if select_isa(cpu_only.cpu.features).tier != "avx512":
        pytest.skip("the int8 expert sums need AVX-512")
    r = _build(moe_dir, cpu_only, cache_dir, "q4_k_m")
    session = Session.load(r.bundle_dir)
    ffn = session.cpu_stage._moe
    experts = session.cpu_stage.bindings[0].post[-1]
    spec, rng = r.spec, np.random.default_rng(0)
    S = moe_experts.ROWS_PER_CALL + 37                                        # two calls, the second partial
    m = rng.standard_normal((S, spec.hidden_size)).astype(np.float32)       # [S, H]
    idx, w = moe_experts.route(rng.standard_normal((S, spec.moe.num_experts)).astype(np.float32), spec.moe)
    got = ffn.expert_sum("prefill", m, idx, w, experts)                      # [S, H]
    for row in (0, moe_experts.ROWS_PER_CALL - 1, moe_experts.ROWS_PER_CALL, S - 1):
        one = ffn.expert_sum("decode", m[row:row + 1], idx[row:row + 1], w[row:row + 1], experts)   # [1, H]
        assert np.array_equal(got[row:row + 1], one), row


@pytest.mark.slow
def test_mxfp4_experts_match_transformers(moe_dir, cpu_only, cache_dir, tmp_path):
    """gpt-oss's layout: the stacked experts (ffn_*_exps) of a q8_0 file re-encoded as MXFP4, the rest q8_0. The
    build reads each expert as a view of its stacked MXFP4 tensor and runs it on the MXFP4 kernels (on AVX-512 a
    block's selected experts in one call of the int8 expert sum); it matches
    transformers on the gguf package's dequantization of that file."""
    from test_quantized_models import _with_linears_as

    from helmc import api
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.runtime.session import Session
    from helmc.testing import hf_on_dequantized_weights
    q8 = quantize_checkpoint(moe_dir, "q8_0", str(tmp_path / "q8"))
    path = str(tmp_path / "mxfp4-experts.gguf")
    changed = _with_linears_as(q8, path, "mxfp4", select=lambda t: "_exps." in t.name)
    assert len(changed) == 2 * 3                                     # blocks 0 and 2: gate, up, down
    r = api.build(path, cpu_only, str(tmp_path / "bundle"), cache_dir=cache_dir, quiet=True)
    assert r.spec.expert_types[0] == ("mxfp4",) * 3 and r.spec.expert_types[2] == ("mxfp4",) * 3
    assert r.spec.layer_types[0][0] == "q8_0"
    session = Session.load(r.bundle_dir)
    if select_isa(cpu_only.cpu.features).tier == "avx512":
        # decode runs each block's MXFP4 experts in one call (schedules/cpu/quant/moe_experts.py, the int8 path)
        assert r.spec.expert_signatures()[0] == ("mxfp4",) * 3
        assert sorted(find_expert_sums(session.cpu_stage.vm, r.spec)) == [0]     # the one expert signature
    compare(session, hf_on_dequantized_weights(moe_dir, path), "qwen3_moe GGUF, mxfp4 experts",
            prefill_tol=INT8_EXPERT_PREFILL_TOL)


def test_stacked_expert_tensor_of_a_wrong_shape_is_one_line(tmp_path):
    from helmc.errors import HelmcError
    from helmc.model.gguf_spec import read_gguf_spec
    path = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32); w.add_feed_forward_length(32)
    w.add_head_count(2); w.add_head_count_kv(1); w.add_key_length(16); w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6); w.add_expert_count(4); w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float16))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4 * 32, 32), np.float16))   # 2-D: not stacked
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(HelmcError, match="blk.0.ffn_gate_exps.weight.*expected GGUF dims \\[cols, rows, experts\\]") as e:
        read_gguf_spec(path)
    assert "\n" not in str(e.value)


def test_q4_k_m_batched_steps_equal_single_runs(moe_dir, cpu_only, cache_dir):
    """Single decode rows take the one-row expert sum, batched steps the m-row one: the same bits per row."""
    from batch_decode_checks import batched_runs, compare, prompts, single_runs

    from helmc.runtime.session import Session
    if select_isa(cpu_only.cpu.features).tier != "avx512":
        pytest.skip("the one-call expert sums need AVX-512")
    r = _build(moe_dir, cpu_only, cache_dir, "q4_k_m")
    session = Session.load(r.bundle_dir)
    assert sorted(find_expert_sums(session.cpu_stage.vm, r.spec, rows=True)) == [0, 1]
    ps = prompts(r.spec.vocab_size, 6)
    singles = single_runs(session, ps, 8)
    batched, sizes = batched_runs(session, ps, 8, max_batch=4, stagger=1)
    assert {2, 3, 4} <= set(sizes), sizes                # padded (3 -> 4) and exact steps both ran
    compare(singles, batched, "qwen3_moe q4_k_m")
