"""gpt-oss from `gpt-oss` GGUF files laid out as llama.cpp's converter writes them (conversion/gpt_oss.py): the fused
experts split into ffn_{gate,up,down}_exps stacks [E, rows, cols] with their `.bias` stacks [E, rows], the router
as ffn_gate_inp (+ bias), attn_sinks, attn_output.bias, the MLP's norm as post_attention_norm, YaRN and the sliding
window as keys (every other block global, llama.cpp's pattern for it).

- An F32 twin of the tiny fp32 HF directory (YaRN's ramp truncated, as llama.cpp runs it): built from the file,
  its prefill logits and 24 greedy tokens equal the HF directory's bundle's exactly.
- A file written by llama.cpp's own convert_hf_to_gguf.py (from ../shared/peers' source; skipped without it) of the
  same tiny model: the same spec, and its bundle's logits and greedy tokens equal the HF directory's exactly.
- MXFP4 experts with Q8_0 attention and head (llama.cpp's gpt-oss mix: experts MXFP4, the rest 8-bit or float):
  against transformers in fp32 on the weights the gguf package dequantizes. Prompts and decode rows take the CPU's
  biased int8 expert sums (a prompt's and a batched step's m rows, a decode row's one call): the prompt's rows and
  teacher-forced decode steps within the int8 experts' bound of transformers' logits wherever they route alike,
  routing apart only at near ties of transformers' router logits; greedy identical, or each side's token in the
  other's top 5 at the divergence; each sequence of a batched decode bit-identical to its single run.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from batch_decode_checks import batched_runs, compare as check_batched, prompts, single_runs
from test_quantized_models import INT8_EXPERT_PREFILL_TOL, NEW_TOKENS, PROMPT, check_greedy, hf_greedy

gguf = pytest.importorskip("gguf")
pytest.importorskip("tvm.relax")

from helmc.runtime.moe_experts import find_expert_sums  # noqa: E402
from helmc.testing import hf_on_gpt_oss_gguf as hf_on_gguf_weights, write_gpt_oss_gguf  # noqa: E402
from helmc.schedules.cpu.isa import select_isa  # noqa: E402

ARCH = "GptOssForCausalLM"
# llama.cpp runs YaRN with the ramp's ends rounded (truncate); gpt-oss's own config says false, which a GGUF has no
# key for: the twins are made with the ramp llama.cpp runs
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "truncate": True}
@pytest.fixture(scope="module")
def cpu_only(host_hardware):
    return dataclasses.replace(host_hardware, gpu=None, link=None)


def test_gguf_twin_is_the_hf_model_exactly(tmp_path, cpu_only, cache_dir):
    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    d = str(tmp_path / "model")
    make_tiny_model(d, "gpt_oss", num_layers=4, rope_parameters=YARN, swiglu_limit=7.0)   # llama.cpp's fixed limit
    path = str(tmp_path / "gpt-oss.gguf")
    write_gpt_oss_gguf(d, path)
    a = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert b.spec.architecture == ARCH and b.spec.moe == a.spec.moe
    for f in ("rope", "global_layers", "sliding_window", "o_bias", "attn_sinks", "qkv_bias", "head_dim"):
        assert getattr(b.spec, f) == getattr(a.spec, f), f
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4
    info = sb.checkpoint.info("model.layers.2.mlp.experts.5.up_proj.bias")
    assert info.gguf_name == "blk.2.ffn_up_exps.5.bias"
    assert sb.checkpoint.info("model.layers.0.self_attn.sinks").gguf_name == "blk.0.attn_sinks.weight"


@pytest.fixture(scope="module")
def mxfp4_build(tmp_path_factory, cpu_only, cache_dir):
    """The tiny gpt-oss as a GGUF of MXFP4 experts, Q8_0 attention and head, built for the CPU with batch 4:
    (model directory, GGUF path, build result)."""
    from helmc import api
    from helmc.testing import make_tiny_model
    tmp = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    d = str(tmp / "model")
    # whole MXFP4 blocks (32) along every expert's input: hidden 128, expert ffn 64
    make_tiny_model(d, "gpt_oss", num_layers=4, rope_parameters=YARN, swiglu_limit=7.0, hidden_size=128,
                    intermediate_size=64)
    path = str(tmp / "gpt-oss-mxfp4.gguf")
    write_gpt_oss_gguf(d, path, experts="mxfp4", linears="q8_0")
    return d, path, api.build(path, cpu_only, str(tmp / "bundle"), cache_dir=cache_dir, quiet=True, batch=4)


def test_mxfp4_experts_match_transformers(mxfp4_build, cpu_only):
    from helmc.runtime.session import Session
    d, path, r = mxfp4_build
    assert set(r.spec.expert_types) == {("mxfp4", "mxfp4", "mxfp4")}
    assert r.spec.layer_types[0][:4] == ("q8_0",) * 4 and r.spec.head_type == "q8_0"
    s = Session.load(r.bundle_dir)
    if select_isa(cpu_only.cpu.features).tier == "avx512":       # the biased one-call sums: one row and m rows
        assert find_expert_sums(s.cpu_stage.vm, r.spec) and find_expert_sums(s.cpu_stage.vm, r.spec, rows=True)
        assert all(len(b.post[-1].stacked) == 6 for b in s.cpu_stage.bindings)   # weights, then the fp32 biases
        from helmc.runtime.moe_expert_rate import measure_expert_sum
        rates = measure_expert_sum(s)                          # helmc calibrate's rate of the one-call sum
        assert [(t, n) for t, n, _ in rates] == [("mxfp4", 1), ("mxfp4", 2), ("mxfp4", 3)] and all(r > 0 for *_, r in rates)
    hf = hf_on_gguf_weights(d, path)
    check_routed_rows(s, hf, PROMPT, lambda: s.forward(PROMPT, all_logits=True), "gpt-oss mxfp4 prompt")
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    check_greedy(s, hf, got, hf_greedy(hf, PROMPT, NEW_TOKENS), "gpt-oss mxfp4 experts")
    s.reset()
    ps = prompts(r.spec.vocab_size, 6)
    singles = single_runs(s, ps, 8)
    batched, sizes = batched_runs(s, ps, 8, max_batch=4, stagger=1)
    assert {2, 3, 4} <= set(sizes), sizes
    check_batched(singles, batched, "gpt-oss mxfp4")


# Decode steps and prompts on the CPU (AVX-512) run gpt-oss's experts through the int8 expert sums (x and each
# expert's weighted SwiGLU int8 per 32 values, as llama.cpp's q8 activations): on this model each block's expert sum
# is the float64 sum of the same math on those int8 activations to 2e-7, and 1.1e-2 to 1.3e-2 (max error over max
# value) from it on fp32 activations, the other MoE models' int8 error; teacher-forced decode logits measured 0.5e-2 to
# 1.04e-2 from transformers' at every step that routes as transformers does, within the other tiny MoE models' int8
# bound. A row that routes otherwise jumps: gpt-oss softmaxes over its top-k router logits alone, so the k-th expert
# carries 0.1 to 0.3 of the weight and swapping it for the (k+1)-th moves the block's output by that share of an expert
# (3.3e-2 at step 24, where block 2's 3rd and 4th logits tie within 2e-4 and even the fp32 path routes apart from
# transformers; 0.14 on the prompt, whose int8 rows swapped block 2's 3rd expert at a gap of 6e-3). Such a swap is
# fair only at a near tie: a router logit's own error is a few 1e-3.
ROUTE_TIE = 1e-2


def check_routed_rows(s, hf, seq: list[int], run, label: str) -> None:
    """run() -> our logits [T, V] of `seq` (one prompt, or one decode step a token), routed by moe_experts.route
    (recorded here); against transformers' logits of seq: within INT8_EXPERT_PREFILL_TOL at every row before the
    first whose blocks do not all select transformers' experts; any other selection only at a near tie of
    transformers' k-th and (k+1)-th router logits (ROUTE_TIE), in at most 3 rows."""
    from helmc.runtime import moe_experts
    theirs_route = []                               # per block: (router logits [T, E], experts [T, k])
    hooks = [layer.mlp.router.register_forward_hook(
        lambda mod, inp, out: theirs_route.append((out[0].numpy(), out[2].numpy()))) for layer in hf.model.layers]
    with torch.no_grad():
        theirs = hf(torch.tensor([seq])).logits[0].numpy()                                    # [T, V]
    for h in hooks:
        h.remove()
    calls = []                                      # each route() call's experts [rows, k]
    route = moe_experts.route
    moe_experts.route = lambda logits, moe: calls.append(route(logits, moe)) or calls[-1]
    try:
        ours = run()                                                                          # [T, V]
    finally:
        moe_experts.route = route
    L, T, k = len(theirs_route), len(seq), s.spec.moe.top_k
    ours_idx = [np.concatenate([c[0] for c in calls[b::L]]) for b in range(L)]               # per block [T, k]
    assert all(i.shape == (T, k) for i in ours_idx), [i.shape for i in ours_idx]
    apart = {(p, b) for p in range(T) for b in range(L) if set(ours_idx[b][p]) != set(theirs_route[b][1][p])}
    for p, b in sorted(apart):
        top = np.sort(theirs_route[b][0][p])[::-1]
        print(f"{label}: row {p} block {b}: experts {sorted(theirs_route[b][1][p].tolist())} -> "
              f"{sorted(ours_idx[b][p].tolist())}, transformers' k-th and (k+1)-th router logits "
              f"{top[k - 1]:.5f} / {top[k]:.5f}")
        assert top[k - 1] - top[k] < ROUTE_TIE, (p, b)
    # the rows before the first swap: a swapped row's output reaches every later row through the next blocks'
    # attention (the prompt above: rows 4-8 at 5e-2 after row 3's swap in block 2)
    first = min((p for p, _ in apart), default=T)
    rel = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max()                            # [T]
    print(f"{label}: {first}/{T} rows before any routes apart from transformers, their logits max rel diff "
          f"{rel[:first].max():.2e}; all rows {rel.max():.2e}")
    assert len({p for p, _ in apart}) <= 3 and first >= min(T, 3)
    assert rel[:first].max() < INT8_EXPERT_PREFILL_TOL


def test_mxfp4_decode_steps_match_transformers(mxfp4_build):
    """Every token of the prompt and transformers' greedy continuation fed as a decode step (check_routed_rows)."""
    from helmc.runtime.session import Session
    d, path, r = mxfp4_build
    s, hf = Session.load(r.bundle_dir), hf_on_gguf_weights(d, path)
    seq = PROMPT + hf_greedy(hf, PROMPT, 24)
    check_routed_rows(s, hf, seq, lambda: np.stack([s.forward([t])[-1] for t in seq]), "gpt-oss mxfp4 decode steps")


def _llamacpp_source() -> str | None:
    """llama.cpp's source tarball (the peers' folder beside the repository, or $HELMC_LLAMACPP_SRC)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in (os.environ.get("HELMC_LLAMACPP_SRC", ""), os.path.join(root, "..", "shared", "peers",
                 "llama.cpp-src.tar.gz"), os.path.join(root, "..", "..", "shared", "peers", "llama.cpp-src.tar.gz")):
        if path and os.path.isfile(path):
            return path
    return None


# llama.cpp's converter, run as is but for its pre-tokenizer check (the toy tokenizer's hash is no known model's)
_CONVERT = """import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-4o"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


@pytest.mark.skipif(_llamacpp_source() is None, reason="needs llama.cpp's source (../shared/peers/llama.cpp-src.tar.gz "
                                                       "or HELMC_LLAMACPP_SRC)")
def test_file_of_llamacpps_converter_is_the_hf_model_exactly(tmp_path, cpu_only, cache_dir):
    """The tiny model converted by llama.cpp's own convert_hf_to_gguf.py (F32; its GptOssModel splits gate_up and
    the biases itself): the same spec and, built, logits and greedy tokens equal to the HF directory's bundle's."""
    import subprocess
    import sys
    import tarfile

    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    src = tmp_path / "llama.cpp"
    with tarfile.open(_llamacpp_source()) as tar:
        tar.extractall(src, members=[m for m in tar.getmembers() if m.name.startswith(
            ("./convert_hf_to_gguf.py", "./conversion/", "./gguf-py/"))], filter="data")
    (tmp_path / "convert.py").write_text(_CONVERT)
    d, path = str(tmp_path / "model"), str(tmp_path / "converted.gguf")
    make_tiny_model(d, "gpt_oss", num_layers=4, rope_parameters=YARN, swiglu_limit=7.0)
    proc = subprocess.run([sys.executable, str(tmp_path / "convert.py"), str(src), d, "--outtype", "f32", "--outfile",
                           path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    a = api.build(d, cpu_only, d + ".bundle", cache_dir=cache_dir, quiet=True)
    b = api.build(path, cpu_only, str(tmp_path / "gguf.bundle"), cache_dir=cache_dir, quiet=True)
    assert dataclasses.replace(b.spec, eos_token_ids=(), bos_token_id=-1) == \
        dataclasses.replace(a.spec, eos_token_ids=(), bos_token_id=-1)
    sa, sb = Session.load(a.bundle_dir), Session.load(b.bundle_dir)
    assert np.array_equal(sa.forward(PROMPT, all_logits=True), sb.forward(PROMPT, all_logits=True))
    sa.reset(); sb.reset()
    ta = sa.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens
    assert ta == sb.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens and len(set(ta)) > 4
