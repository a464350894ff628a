"""benchmarks/make_gguf.py's mixture of experts (`--config qwen3-30b-a3b`) at a tiny size: 4 blocks of 32 experts,
top-4, hidden 256 and expert ffn 256 (whole K-quant blocks).

- The file is a `qwen3moe` GGUF as llama.cpp's converter lays it out: the experts' keys, each block's router F32
  [E, H] and its experts stacked [E, rows, cols] per kind; Q4_K_M's types as llama-quant.cpp gives them (written out
  here from its use_more_bits: ffn_down_exps and attn_v Q6_K in blocks 2 and 3 of 4, the rest Q4_K, output Q6_K);
  the experts' weights at std ~0.02 and mean ~0 by gguf's own dequantization, the router's at its std, the q/k
  norms at their gain; the same seed writes the same bytes.
- Built for the CPU, the tokens of a random 64-token prompt spread over more than half of each block's experts;
  the same file with blocks of random quants under positive scales (dmin 0) sends them to a few.
- The bundle is transformers' model on gguf's dequantization of the file: prefill logits within 1e-2 (rows whose
  routing is a near tie aside), greedy tokens identical (or each side's token in the other's top 5 at the first
  divergence: the quantized tests' rule).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from benchmarks.make_gguf import QK_NORM_GAIN, ROUTER_STD, make_gguf  # noqa: E402

TINY_MOE = dict(hidden=256, ffn=512, heads=2, kv_heads=1, head_dim=128, layers=4, vocab=512,
                experts=32, experts_used=4, expert_ffn=256)
MORE_BITS = {2, 3}            # llama.cpp's use_more_bits(i, 4): i >= 7 * 4 // 8 or (i - 0) % 3 == 2


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe-gguf") / "qwen3-30b-a3b-q4_k_m.gguf")
    make_gguf(path, "qwen3-30b-a3b", "q4_k_m", seed=3, **TINY_MOE)
    return path


def field(r, key):
    f = r.fields[key]
    return f.contents()


def expected_type(name: str) -> str:
    role = name.split(".")[-2]
    if name.endswith("norm.weight") or role == "ffn_gate_inp":
        return "f32"
    if name == "output.weight":
        return "q6_k"
    if role in ("attn_v", "ffn_down_exps") and int(name.split(".")[1]) in MORE_BITS:
        return "q6_k"
    return "q4_k"


def test_layout_metadata_and_types_are_llama_cpps(moe_file):
    r = gguf.GGUFReader(moe_file)
    assert field(r, "general.architecture") == "qwen3moe"
    assert field(r, "general.file_type") == 15                      # LLAMA_FTYPE_MOSTLY_Q4_K_M
    for key, want in (("expert_count", 32), ("expert_used_count", 4), ("expert_feed_forward_length", 256),
                      ("feed_forward_length", 512), ("block_count", 4), ("attention.head_count_kv", 1)):
        assert field(r, f"qwen3moe.{key}") == want, key
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}     # GGUF order: (cols, rows, experts)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (256, 32)
    assert shapes["blk.3.ffn_gate_exps.weight"] == shapes["blk.3.ffn_up_exps.weight"] == (256, 256, 32)
    assert shapes["blk.1.ffn_down_exps.weight"] == (256, 256, 32)
    assert not any(".ffn_gate.weight" in n or ".ffn_down.weight" in n for n in shapes)
    for t in r.tensors:
        want = expected_type(t.name)
        assert t.tensor_type.name.lower() == want, t.name
        w = gguf.dequantize(t.data, t.tensor_type)
        if t.name.endswith("ffn_gate_inp.weight"):
            assert abs(w.std() - ROUTER_STD) < 0.1 * ROUTER_STD and abs(w.mean()) < 0.05 * ROUTER_STD, t.name
        elif t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            assert (w == QK_NORM_GAIN).all(), t.name
        elif want == "f32":
            assert (w == 1).all(), t.name
        else:
            assert 0.017 < w.std() < 0.023 and abs(w.mean()) < 2e-3, (t.name, w.std(), w.mean())
            if t.name.endswith("_exps.weight"):          # each expert's rows centred too, not only the stack
                per_expert = w.reshape(32, -1).mean(axis=1)
                assert np.abs(per_expert).max() < 2e-3, t.name


def test_same_seed_same_bytes(moe_file, tmp_path):
    from tests.bench.test_make_gguf import file_digest
    again, other = str(tmp_path / "again.gguf"), str(tmp_path / "other.gguf")
    make_gguf(again, "qwen3-30b-a3b", "q4_k_m", seed=3, **TINY_MOE)
    make_gguf(other, "qwen3-30b-a3b", "q4_k_m", seed=4, **TINY_MOE)
    assert file_digest(again) == file_digest(moe_file) != file_digest(other)


def test_helmc_reads_the_file_as_qwen3_moe(moe_file):
    from helmc.model.gguf_spec import read_gguf_spec
    spec = read_gguf_spec(moe_file)          # every tensor's presence, shape and type checked against the spec
    assert spec.architecture == "Qwen3MoeForCausalLM" and spec.num_layers == 4
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.norm_topk_prob, moe.dense_layers) == \
        (32, 4, 256, True, ())


@pytest.fixture(scope="module")
def moe_session(moe_file, host_hardware, cache_dir, tmp_path_factory):
    pytest.importorskip("tvm.relax")
    from helmc import api
    from helmc.runtime.session import Session
    hw = dataclasses.replace(host_hardware, gpu=None, link=None)
    out = str(tmp_path_factory.mktemp("moe-bundle") / "b")
    return Session.load(api.build(moe_file, hw, out, cache_dir=cache_dir, quiet=True).bundle_dir)


def test_routing_spreads_over_the_experts(moe_session):
    from benchmarks.moe_routing_spread import measure_spread, random_prompt
    blocks = measure_spread(moe_session, random_prompt(TINY_MOE["vocab"], 64, seed=1), hot=4)
    assert [b.layer for b in blocks] == [0, 1, 2, 3] and all(b.tokens == 64 for b in blocks)
    print("\n" + "\n".join(str(b) for b in blocks))
    for b in blocks:
        assert b.distinct > TINY_MOE["experts"] // 2, b
        assert b.hottest_share < 0.5, b                  # the hottest eighth: 0.125 at an even spread
        assert 0.2 < b.topk_mass < 0.95, b               # the softmax neither uniform (0.125) nor one-hot


def test_positive_blocks_route_to_few_experts(tmp_path, monkeypatch, host_hardware, cache_dir):
    """The measure tells the two apart: the same file with every Q4_K block's dmin 0 (weights d * sc * q, all >= 0,
    as the peer script's blocks nearly are) sends the prompt to a few experts of a block. Q4_K_M as the file: the
    blocks of its q6_k down projections and attn_v (blocks 2 and 3) keep their signs, and its types are the file's,
    so the build is moe_session's compiled stage from the artifact cache (its own compile: ~35 s on 2 cores)."""
    pytest.importorskip("tvm.relax")
    import benchmarks.make_gguf as mg
    from benchmarks.moe_routing_spread import measure_spread, random_prompt
    from helmc import api
    from helmc.runtime.session import Session
    monkeypatch.setitem(mg.SCALE_FIELDS, "q4_k", (0, 2, 0.0))
    path = str(tmp_path / "positive.gguf")
    make_gguf(path, "qwen3-30b-a3b", "q4_k_m", seed=3, **TINY_MOE)
    hw = dataclasses.replace(host_hardware, gpu=None, link=None)
    s = Session.load(api.build(path, hw, str(tmp_path / "b"), cache_dir=cache_dir, quiet=True).bundle_dir)
    blocks = measure_spread(s, random_prompt(TINY_MOE["vocab"], 64, seed=1), hot=4)
    print("\n" + "\n".join(str(b) for b in blocks))
    assert all(b.distinct <= TINY_MOE["experts"] // 4 and b.hottest_share > 0.9 for b in blocks)


def routing_margins(ref, ids: list[int], k: int) -> np.ndarray:
    """Per prompt row, the least gap over the blocks between the reference router's k-th and (k+1)-th logits."""
    import torch
    gaps = []

    def gap(mod, inp, out):
        logits = (inp[0].reshape(-1, inp[0].shape[-1]) @ mod.weight.T).numpy()
        top = -np.sort(-logits, axis=-1)                  # descending
        gaps.append(top[:, k - 1] - top[:, k])
    hooks = [layer.mlp.gate.register_forward_hook(gap) for layer in ref.model.layers]
    with torch.no_grad():
        ref(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return np.min(gaps, axis=0)


def test_bundle_is_transformers_on_the_dequantized_file(moe_file, moe_session, tmp_path):
    """Prefill logits within 1e-2 of the reference's largest on every row whose routing has no near tie (a top-k
    decided by less than 2e-3 of a logit, about what the bundle's fp16 routing input moves a logit of this size by,
    so it may decide it the other way: 3 of this prompt's 9 rows, one of which does), at least half the rows; then
    the quantized tests' greedy rule."""
    import torch

    from helmc.testing import hf_on_dequantized_weights, make_tiny_model
    from tests.compiler.test_quantized_models import NEW_TOKENS, PROMPT, check_greedy, hf_greedy
    t = TINY_MOE
    model_dir = str(tmp_path / "hf")                 # the file's config; its weights are all replaced by the file's
    make_tiny_model(model_dir, "qwen3_moe", num_layers=t["layers"], head_dim=t["head_dim"], tie=False,
                    hidden_size=t["hidden"], intermediate_size=t["ffn"], num_attention_heads=t["heads"],
                    num_key_value_heads=t["kv_heads"], vocab_size=t["vocab"], num_experts=t["experts"],
                    num_experts_per_tok=t["experts_used"], moe_intermediate_size=t["expert_ffn"], mlp_only_layers=[])
    ref = hf_on_dequantized_weights(model_dir, moe_file)
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].numpy()
    moe_session.reset()
    ours = moe_session.forward(PROMPT, all_logits=True)
    rel = np.abs(ours - theirs).max(axis=-1) / np.abs(theirs).max()
    clear = routing_margins(ref, PROMPT, t["experts_used"]) > 2e-3
    print(f"\nprefill logits max rel diff per row {rel.round(4)}; rows routed without a near tie {clear.astype(int)}")
    assert clear.sum() >= len(PROMPT) // 2 and rel[clear].max() < 1e-2
    moe_session.reset()
    got = list(moe_session.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens)
    check_greedy(moe_session, ref, got, hf_greedy(ref, PROMPT, NEW_TOKENS), "make_gguf qwen3-30b-a3b")
