"""Quantized weights end to end: `helmc build --quant` from safetensors and `helmc build model.gguf`, against
Hugging Face transformers in fp32 on the weights dequantized by the gguf package's own NumPy code (not helmc's).

Tiny random-weight models of real architectures with K-quant-sized dimensions (hidden 256, ffn 512: whole
256-weight blocks). Pass: greedy 16 tokens identical, or HF's token in helmc's top 5 at the first divergence
(and the other way round); prefill logits within 1e-2 relative (the prompt's GEMMs read the weights dequantized
to fp16, ~5e-4 per weight; decode reads them in registers in fp32). The max relative logit difference is
printed. References are recomputed from transformers on every run; nothing is stored.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tiny_shapes import KQUANT_DIMS

gguf = pytest.importorskip("gguf")

from helmc.testing import hf_on_dequantized_weights  # noqa: E402

PROMPT = [1, 17, 250, 33, 100, 7, 2, 480, 64]
DIMS = {k: v for k, v in KQUANT_DIMS.items() if k not in ("num_layers", "head_dim")}
NEW_TOKENS = 16


def _bundle_weights(bundle_dir: str) -> str:
    from helmc.runtime.bundle.manifest import verify_bundle
    return verify_bundle(bundle_dir).weights_dir


def hf_greedy(model, ids, n):
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


# A prompt's quantized experts take int8 activations (runtime/moe_experts.py: the m-row expert sum), as decode steps
# do and as llama.cpp's q8 activations do: the tiny MoE models' prompt logits measured 1.35e-2 to 1.78e-2 from
# transformers' fp32 on the same dequantized weights (1e-3 where the experts are q8_0, which take the fp32 path).
INT8_EXPERT_PREFILL_TOL = 2e-2


def compare(session, ref, label: str, prefill_tol: float = 1e-2):
    """Prefill logits within prefill_tol of the reference (relative to its largest), greedy tokens identical or the
    reference's token in our top 5 where they part."""
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].numpy()
    ours = session.forward(PROMPT, all_logits=True)
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    session.reset()
    got = session.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    same = sum(a == b for a, b in zip(got, expected))
    print(f"\n{label}: prefill logits max rel diff {rel:.2e} vs HF fp32 on gguf-dequantized weights; "
          f"greedy {same}/{NEW_TOKENS} identical")
    assert rel < prefill_tol
    check_greedy(session, ref, got, expected, label)


def check_greedy(session, ref, got: list[int], expected: list[int], label: str) -> None:
    """The reference's greedy tokens after PROMPT are not one token repeated, and where helmc's (`got`) part from
    them, each side's token is in the other's top 5 there."""
    assert len(set(expected)) > 1, "degenerate reference: the test would not catch a wrong model"
    if got != expected:
        i = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
        ctx = PROMPT + expected[:i]
        with torch.no_grad():
            their_top5 = np.argsort(-ref(torch.tensor([ctx])).logits[0, -1].numpy())[:5]
        session.reset()
        our_top5 = np.argsort(-session.forward(ctx)[-1])[:5]
        print(f"{label}: first divergence at token {i}: helmc {got[i]}, HF {expected[i]}")
        assert got[i] in their_top5 and expected[i] in our_top5, (i, got, expected)


@pytest.fixture(scope="module")
def cpu_hardware(host_hardware):
    import dataclasses
    return dataclasses.replace(host_hardware, gpu=None, link=None)


# These two are tests/runtime/test_batch_decode_cpu.py's batch-4 bundles: a batch-4 bundle decodes one sequence with
# the functions a batch-1 bundle has, so one build serves both files.
SHARED_BATCH = {("qwen3", "q4_k_m"): 4, ("qwen3", "q8_0"): 4}


@pytest.mark.parametrize("arch,quant", [("qwen3", "q8_0"), ("qwen3", "q4_0"), ("qwen3", "q4_k_m"),
                                        ("qwen3", "q5_k_m"), ("qwen3", "q3_k_m"), ("llama", "q4_k"),
                                        ("qwen2", "q8_0")])
def test_quant_at_build_matches_transformers(arch, quant, tiny, cache_dir):
    from helmc.runtime.session import Session
    model_dir, _ = tiny.model(arch, "float16", **KQUANT_DIMS)       # 3 layers, head_dim 64: the session's shared model
    r = tiny.build(arch, "float16", quant=quant, cpu_only=True, batch=SHARED_BATCH.get((arch, quant), 1),
                   **KQUANT_DIMS)
    assert r.spec.quantized and r.plan.placement.cpu_units == r.spec.num_units
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    path = quantize_checkpoint(model_dir, quant, os.path.join(cache_dir, "weights"))   # the build's file, cached
    assert r.bundle_dir and os.path.samefile(path, _bundle_weights(r.bundle_dir))
    if quant in ("q4_k_m", "q5_k_m"):        # llama.cpp's mix: two block signatures, the lm_head in q6_k
        assert len(r.spec.block_signatures()) == 2 and r.spec.head_type == "q6_k"
        assert {t for sig in r.spec.block_signatures() for t in sig} == {quant[:4], "q6_k"}
    if quant == "q3_k_m":        # 3 blocks: attn_v q5_k in blocks 0-1, q4_k in block 2; o_proj, down_proj q4_k
        assert len(r.spec.block_signatures()) == 2 and r.spec.head_type == "q6_k"
        assert {t for sig in r.spec.block_signatures() for t in sig} == {"q3_k", "q4_k", "q5_k"}
    compare(Session.load(r.bundle_dir), hf_on_dequantized_weights(model_dir, path), f"{arch} --quant {quant}")


GGUF_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def gguf_build(tmp_path_factory, cpu_hardware, cache_dir):
    """(model dir, GGUF file, BuildResult): an untied 2-layer Qwen3 with a chat template, quantized to q4_k by
    helmc and built from the GGUF file (the GGUF input test's and the calibration test's one bundle)."""
    from helmc import api
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.testing import make_tiny_model
    root = tmp_path_factory.mktemp("gguf-build")
    model_dir = str(root / "model")
    make_tiny_model(model_dir, "qwen3", num_layers=2, head_dim=64, dtype="float16", tie=False, **DIMS)
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": GGUF_TEMPLATE}, f)
    path = quantize_checkpoint(model_dir, "q4_k", str(root / "gguf"))
    return model_dir, path, api.build(path, cpu_hardware, str(root / "bundle"), cache_dir=cache_dir, quiet=True)


def test_gguf_file_builds_and_matches(gguf_build):
    """A GGUF file as the model input: spec, types and tokenizer from the file, weights mmapped from it."""
    from helmc.runtime.session import Session
    model_dir, path, r = gguf_build
    assert r.spec.layer_types[0] == ("q4_k",) * 7 and r.spec.head_type == "q4_k"
    s = Session.load(r.bundle_dir)
    assert s.tokenizer is not None and s.tokenizer.encode("helmc compiles").ids     # read from the GGUF file
    with open(os.path.join(r.bundle_dir, "chat_template.jinja")) as f:              # the GGUF's template travels too
        assert f.read() == GGUF_TEMPLATE
    assert "chat_template.jinja" in [f.path for f in s.manifest.files]
    compare(s, hf_on_dequantized_weights(model_dir, path), "qwen3 GGUF q4_k")


def _block_linear(t) -> bool:
    return t.name.startswith("blk.") and len(t.shape) == 2 and int(t.shape[0]) % 256 == 0


def _with_linears_as(src: str, dst: str, linear_type: str, select=_block_linear) -> list[str]:
    """Copy the GGUF file src to dst with every tensor `select` picks (default: every linear of the blocks; a stacked
    expert tensor [experts, rows, k] too) re-encoded as linear_type (gguf's dequantization of its blocks through
    helmc's quantizer, ggml's reference); metadata and the other tensors as they are. Returns the re-encoded
    tensors' names."""
    from helmc.model.quant_formats import quantize
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue                                 # written by GGUFWriter itself
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    changed = []
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if select(t):
            dense = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)        # [..., rows, k] float32
            data = quantize(dense.reshape(-1, int(t.shape[0])), linear_type).reshape(*dense.shape[:-1], -1)
            qtype = gguf.GGMLQuantizationType[linear_type.upper()]
            changed.append(t.name)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


@pytest.mark.slow
def test_iq4_xs_gguf_builds_and_matches(tmp_path, cpu_hardware, cache_dir):
    """A GGUF file whose block linears are IQ4_XS (the embedding and the lm_head q8_0) builds on the CPU stage's
    IQ4_XS kernels and matches transformers on the gguf package's dequantization of that file."""
    from helmc import api
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    model_dir = str(tmp_path / "model")
    make_tiny_model(model_dir, "qwen3", num_layers=2, head_dim=64, dtype="float16", tie=False, **DIMS)
    q8 = quantize_checkpoint(model_dir, "q8_0", str(tmp_path / "gguf"))
    path = str(tmp_path / "iq4_xs.gguf")
    assert len(_with_linears_as(q8, path, "iq4_xs")) == 2 * 7
    r = api.build(path, cpu_hardware, str(tmp_path / "bundle"), cache_dir=cache_dir, quiet=True)
    assert [tuple(t) for t in r.spec.layer_types] == [("iq4_xs",) * 7] * 2 and r.spec.head_type == "q8_0"
    compare(Session.load(r.bundle_dir), hf_on_dequantized_weights(model_dir, path), "qwen3 GGUF iq4_xs")


@pytest.mark.slow
def test_mxfp4_gguf_builds_and_matches(tmp_path, cpu_hardware, cache_dir):
    """A GGUF file whose block linears are MXFP4 (gpt-oss's expert type; the embedding and the lm_head q8_0) builds on
    the CPU stage's MXFP4 kernels (decode GEMV, prefill dequantizer) and matches transformers on the gguf package's
    dequantization of that file."""
    from helmc import api
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    model_dir = str(tmp_path / "model")
    make_tiny_model(model_dir, "qwen3", num_layers=2, head_dim=64, dtype="float16", tie=False, **DIMS)
    q8 = quantize_checkpoint(model_dir, "q8_0", str(tmp_path / "gguf"))
    path = str(tmp_path / "mxfp4.gguf")
    assert len(_with_linears_as(q8, path, "mxfp4")) == 2 * 7
    r = api.build(path, cpu_hardware, str(tmp_path / "bundle"), cache_dir=cache_dir, quiet=True)
    assert [tuple(t) for t in r.spec.layer_types] == [("mxfp4",) * 7] * 2 and r.spec.head_type == "q8_0"
    compare(Session.load(r.bundle_dir), hf_on_dequantized_weights(model_dir, path), "qwen3 GGUF mxfp4")


def _llama_quantize() -> str | None:
    """llama.cpp's llama-quantize: $HELMC_LLAMA_QUANTIZE, or a build of ../shared/peers/build_llamacpp.sh in /tmp/lc."""
    for path in (os.environ.get("HELMC_LLAMA_QUANTIZE", ""), "/tmp/lc/build/bin/llama-quantize",
                 "/tmp/llamacpp/build/bin/llama-quantize"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@pytest.mark.skipif(_llama_quantize() is None, reason="needs llama.cpp's llama-quantize (../shared/peers/build_llamacpp.sh "
                                                       "/tmp/lc, or HELMC_LLAMA_QUANTIZE)")
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q5_0"])
def test_llama_quantize_file_matches(ftype, tmp_path, cpu_hardware, cache_dir):
    """A Q4_K_M / Q5_K_M / Q3_K_M / Q5_0 file written by llama.cpp's own llama-quantize (from helmc's q8_0 file,
    --allow-requantize) builds, runs and matches transformers on the gguf package's dequantization of that file;
    a _M file's type of every linear is the one helmc's --quant of the same name gives (rows are whole 256-weight
    blocks), a Q5_0 file's linears are all Q5_0 with a Q6_K output."""
    import subprocess

    from helmc import api
    from helmc.compiler.quantize_checkpoint import mixed_type, quantize_checkpoint
    from helmc.model.spec import LINEAR_NAMES
    from helmc.model.weight_types import QUANT_MIXES
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    model_dir = str(tmp_path / "model")
    make_tiny_model(model_dir, "qwen3", num_layers=8, head_dim=64, dtype="float16", tie=False, **DIMS)
    q8 = quantize_checkpoint(model_dir, "q8_0", str(tmp_path / "gguf"))
    out = str(tmp_path / f"{ftype.lower()}.gguf")
    proc = subprocess.run([_llama_quantize(), "--allow-requantize", q8, out, ftype, "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    r = api.build(out, cpu_hardware, str(tmp_path / "bundle"), cache_dir=cache_dir, quiet=True)
    kinds = {t for sig in r.spec.block_signatures() for t in sig}
    print(f"\nllama-quantize {ftype}: block types {sorted(kinds)}, head {r.spec.head_type}, "
          f"{len(r.spec.block_signatures())} block signatures")
    mix = ftype.lower()
    if mix in QUANT_MIXES:
        assert mix[:4] in kinds and len(r.spec.block_signatures()) >= 2
        assert [tuple(t) for t in r.spec.layer_types] == [
            tuple(mixed_type(mix, f"model.layers.{i}.{n}", 8) for n in LINEAR_NAMES) for i in range(8)]
        assert r.spec.head_type == mixed_type(mix, "lm_head.weight", 8) == "q6_k"
    else:
        assert kinds == {mix} and r.spec.head_type == "q6_k"
    compare(Session.load(r.bundle_dir), hf_on_dequantized_weights(model_dir, out), f"llama-quantize {ftype}")


def test_calibrate_measures_a_quantized_bundle(gguf_build, cpu_hardware):
    """helmc calibrate on a GGUF bundle: its stages bind the raw blocks and the embedding dequantizes its rows
    (runtime/weights/bind.Embedding), and the fit comes out finite. Not its sign: two tiny blocks are read from
    cache, and the quick profile's DRAM roofline for them may be above or below their measured step (CI, session
    19: 0.203 ms measured against 0.228, the profile's reads now medians of their passes)."""
    import math

    from helmc.planner.calibrate import calibrate
    r = gguf_build[2]
    result = calibrate(r.bundle_dir, cpu_hardware, steps=4)
    f = result.fits[0]
    print(result.summary())
    assert f.device == "cpu" and f.blocks == 2 and f.measured_step_ms > 0 and f.roofline_step_ms > 0
    assert math.isfinite(f.block_overhead_ms) and math.isfinite(f.measured_tail_ms) and f.measured_tail_ms > 0
