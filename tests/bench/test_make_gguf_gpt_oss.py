"""benchmarks/make_gguf.py's gpt-oss (`--config gpt-oss-20b --mix mxfp4_moe`) at a tiny size: 2 blocks of 8 experts,
top-2, hidden 128 (whole MXFP4 and Q8_0 blocks).

- The file is a `gpt-oss` GGUF as llama.cpp's loader asks for it (src/models/openai-moe.cpp): every tensor it
  creates, in its shape (the biases of q/k/v/o, the router and each expert stack, a sink per head, the MLP's norm as
  post_attention_norm, no q/k norms), the expert and sliding-window keys, YaRN's; MXFP4_MOE's types as
  llama-quant.cpp gives them (stacked experts MXFP4, every other matrix Q8_0, the output too; norms, router, biases
  and sinks F32); MXFP4 weights at std ~0.02 and mean ~0 by gguf's own dequantization; the same seed, the same bytes.
- helmc reads it as GptOssForCausalLM (every tensor's presence, shape and type checked against the spec), and a
  CPU build of it decodes: finite logits, the routing spread over the experts.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from benchmarks.make_gguf import BIAS_STD, MXFP4_MOE, SINK_STD, make_gguf  # noqa: E402

TINY = dict(hidden=128, ffn=128, heads=4, kv_heads=2, head_dim=32, layers=2, vocab=256, experts=8, experts_used=2,
            expert_ffn=128, sliding_window=8)


@pytest.fixture(scope="module")
def oss_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt-oss-gguf") / "gpt-oss-20b-mxfp4.gguf")
    make_gguf(path, "gpt-oss-20b", MXFP4_MOE, seed=5, **TINY)
    return path


def _llama_cpp_tensors(layers: int) -> dict[str, tuple[int, ...]]:
    """{name: GGUF shape (columns first)} of every tensor llama.cpp's gpt-oss loader creates, at TINY's sizes."""
    H, Q, KV, E, I, V = 128, 4 * 32, 2 * 32, 8, 128, 256
    out = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    for i in range(layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (H,), b + "post_attention_norm.weight": (H,),
                b + "attn_q.weight": (H, Q), b + "attn_k.weight": (H, KV), b + "attn_v.weight": (H, KV),
                b + "attn_q.bias": (Q,), b + "attn_k.bias": (KV,), b + "attn_v.bias": (KV,),
                b + "attn_output.weight": (Q, H), b + "attn_output.bias": (H,), b + "attn_sinks.weight": (4,),
                b + "ffn_gate_inp.weight": (H, E), b + "ffn_gate_inp.bias": (E,),
                b + "ffn_gate_exps.weight": (H, I, E), b + "ffn_up_exps.weight": (H, I, E),
                b + "ffn_down_exps.weight": (I, H, E), b + "ffn_gate_exps.bias": (I, E),
                b + "ffn_up_exps.bias": (I, E), b + "ffn_down_exps.bias": (H, E)}
    return out


def test_layout_metadata_and_types_are_llama_cpps(oss_file):
    r = gguf.GGUFReader(oss_file)
    field = lambda k: r.fields[k].contents()      # noqa: E731
    assert field("general.architecture") == "gpt-oss"
    assert field("general.file_type") == 38                          # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    for key, want in (("expert_count", 8), ("expert_used_count", 2), ("expert_feed_forward_length", 128),
                      ("attention.sliding_window", 8), ("block_count", 2), ("attention.head_count", 4),
                      ("attention.head_count_kv", 2), ("attention.key_length", 32), ("rope.scaling.factor", 32.0),
                      ("rope.scaling.original_context_length", 4096)):
        assert field(f"gpt-oss.{key}") == want, key
    assert field("tokenizer.ggml.pre") == "gpt-4o"
    got = {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}
    assert got == _llama_cpp_tensors(2)
    for t in r.tensors:
        want = "MXFP4" if t.name.endswith("_exps.weight") else "F32" if len(t.shape) == 1 or "bias" in t.name \
            or "ffn_gate_inp" in t.name else "Q8_0"
        assert t.tensor_type.name == want, t.name
    by_name = {t.name: t for t in r.tensors}
    experts = gguf.dequantize(by_name["blk.1.ffn_down_exps.weight"].data, gguf.GGMLQuantizationType.MXFP4)
    assert 0.015 < experts.std() < 0.03 and abs(experts.mean()) < 1e-3
    bias = np.asarray(by_name["blk.0.ffn_up_exps.bias"].data)
    sinks = np.asarray(by_name["blk.1.attn_sinks.weight"].data)
    assert 0.5 * BIAS_STD < bias.std() < 2 * BIAS_STD and sinks.std() > 0.2 * SINK_STD and len(set(sinks)) == 4


def test_same_seed_same_bytes(oss_file, tmp_path):
    again = str(tmp_path / "again.gguf")
    make_gguf(again, "gpt-oss-20b", MXFP4_MOE, seed=5, **TINY)
    assert open(again, "rb").read() == open(oss_file, "rb").read()


def test_mxfp4_moe_needs_experts(tmp_path):
    with pytest.raises(SystemExit, match="mxfp4_moe expected a mixture of experts, found qwen3"):
        make_gguf(str(tmp_path / "x.gguf"), "qwen3-8b", MXFP4_MOE, layers=1, vocab=64)


def test_helmc_reads_and_decodes_the_file(oss_file, host_hardware, cache_dir, tmp_path):
    from helmc.model.gguf_spec import read_gguf_spec
    spec = read_gguf_spec(oss_file)          # every tensor's presence, shape and type checked against the spec
    assert spec.architecture == "GptOssForCausalLM" and spec.num_layers == 2 and spec.attn_sinks and spec.o_bias
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.routing, spec.moe.expert_act) == \
        (8, 2, "topk_softmax", "swiglu_clamped")
    assert [spec.layer_window(i) for i in range(2)] == [8, 0] and spec.rope.kind == "yarn"
    pytest.importorskip("tvm.relax")
    from helmc import api
    from helmc.runtime.session import Session
    hw = dataclasses.replace(host_hardware, gpu=None, link=None)
    s = Session.load(api.build(oss_file, hw, str(tmp_path / "b"), cache_dir=cache_dir, quiet=True).bundle_dir)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 256, 24)]
    s.reset()
    logits = s.forward(prompt, all_logits=True)                                    # [24, vocab]
    assert logits.shape == (24, 256) and np.isfinite(logits).all() and logits.std() > 0.1
    tokens = s.generate(prompt_ids=prompt, max_new_tokens=8, stop_at_eos=False).tokens
    assert len(tokens) == 8 and tokens[0] == int(np.argmax(logits[-1]))
