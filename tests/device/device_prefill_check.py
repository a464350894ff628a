#!/usr/bin/env python3
"""Check the GPU-side prefill paths end to end on the GPU machine, against Hugging Face references made here.

  --build DIR   (here, compiler venv) writes a tiny random-weight Qwen3 (fp16, 4 blocks) and three bundles
      with fixed plans for the measured H100 profile: `split_stream` (2 blocks on the CPU whose prefill
      streams to the GPU, chunks of 8 tokens), `split_cpu` (same split, prefill of those blocks on the
      CPU) and `all_gpu` (chunks of 8); plus DIR/refs.npz: HF transformers' fp32 last-row prefill logits
      and greedy tokens for a 40-token prompt. Regenerate by running --build again.
  DIR [--out FILE]   (GPU machine, runtime-only TVM) loads each bundle, compares the prompt's logits with
      the reference (max |diff| / max |ref|) and its greedy tokens with HF's (identical, or HF's token in
      helmc's top-5 at the first divergence), and split_stream's tokens with split_cpu's. Exits 1 on a mismatch.
  --build DIR --quant q4_k_m   the same three plans for quantized weights: a tiny Qwen3 (hidden 256, ffn 512)
      quantized to a GGUF file (helmc's quantize-at-build; q4_k_m mixes Q4_K and Q6_K: two block signatures),
      bundles built from that file, references from transformers in fp32 on the gguf package's dequantization
      of the same file (helmc.testing.hf_on_dequantized_weights).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

PROMPT_LEN, NEW_TOKENS, CHUNK = 40, 24, 8
LOGIT_TOLERANCE = 2e-2          # fp16 activations on the GPU against an fp32 reference
BUNDLES = ("split_stream", "split_cpu", "all_gpu")


def build(out_dir: str, quant: str = "") -> None:
    from helmc.compiler.pipeline import build as build_bundle
    from helmc.hardware.profile import load_hardware
    from helmc.model.load import load_spec
    from helmc.runtime.bundle.plan import PLAN_FORMAT_VERSION, Plan
    from helmc.testing import hf_prompt_reference, make_tiny_model

    model_dir = os.path.join(out_dir, "model")
    dims = dict(head_dim=64, hidden_size=256, intermediate_size=512) if quant else \
        dict(head_dim=32, hidden_size=128, intermediate_size=384)
    model = make_tiny_model(model_dir, "qwen3", num_layers=4, dtype="float16", seed=7, **dims).float()
    source = model_dir
    if quant:
        from helmc.compiler.quantize_checkpoint import quantize_checkpoint
        from helmc.testing import hf_on_dequantized_weights
        source = quantize_checkpoint(model_dir, quant, os.path.join(out_dir, "gguf"))
        model = hf_on_dequantized_weights(model_dir, source)
    spec = load_spec(source)
    hw = load_hardware(os.path.join(_ROOT, "helmc/hardware/presets/h100-sxm-measured.json"))
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, spec.vocab_size, PROMPT_LEN).tolist()
    common = dict(format_version=PLAN_FORMAT_VERSION, num_layers=spec.num_layers, max_context=512)
    plans = {
        "split_stream": Plan(cpu_units=3, prefill_on_gpu=True, prefill_chunk_tokens=CHUNK, prefill_staging_bytes=1,
                             gpu_kv_pool_bytes=64 << 20, **common),
        "split_cpu": Plan(cpu_units=3, prefill_chunk_tokens=CHUNK, gpu_kv_pool_bytes=64 << 20, **common),
        "all_gpu": Plan(cpu_units=0, prefill_chunk_tokens=CHUNK, gpu_kv_pool_bytes=64 << 20, **common),
    }
    for name, plan in plans.items():
        build_bundle(source, hw, os.path.join(out_dir, name), plan=plan, copy_weights=True, quiet=True)
    logits, greedy = hf_prompt_reference(model, prompt, NEW_TOKENS)
    np.savez(os.path.join(out_dir, "refs.npz"), prompt=np.array(prompt), logits=logits, greedy=greedy)
    print(f"wrote {', '.join(BUNDLES)} and refs.npz under {out_dir}")


def tokens_agree(ours: list[int], ref: list[int], top5_at) -> tuple[bool, int]:
    """(agree, first divergence): identical tokens, or at the first divergence HF's token is in helmc's top 5
    there (top5_at(i): helmc's top-5 ids after its first i tokens)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return bool(b in top5_at(i)), i
    return True, len(ref)


def compare_with_hf(session, prompt: list[int], ref_logits, ref_greedy: list[int], new_tokens: int):
    """One bundle's session against HF's references: (its last prompt logits, their max|diff| / max|ref|, its
    greedy generation (GenerateResult), tokens_agree's (agree, first divergence))."""
    session.reset()
    logits = session.forward(prompt)[-1]
    rel = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
    result = session.generate(prompt_ids=prompt, max_new_tokens=new_tokens, stop_at_eos=False)

    def top5_at(i):
        session.reset()
        return set(np.argsort(session.forward(prompt + result.tokens[:i])[-1])[-5:].tolist())

    agree, first = tokens_agree(result.tokens, ref_greedy, top5_at)
    return logits, rel, result, bool(agree), first


def check(dir_: str, out_path: str | None) -> int:
    from helmc.runtime.session import Session

    refs = np.load(os.path.join(dir_, "refs.npz"))
    prompt, ref_logits, ref_greedy = refs["prompt"].tolist(), refs["logits"], refs["greedy"].tolist()
    results, tokens, ok = {}, {}, True
    for name in BUNDLES:
        s = Session.load(os.path.join(dir_, name))
        _, rel, r, agree, first = compare_with_hf(s, prompt, ref_logits, ref_greedy, NEW_TOKENS)
        toks = r.tokens
        streamed = s.gpu.streamed_prefill.bytes_streamed if s.gpu.streamed_prefill is not None else 0
        results[name] = {"logits_rel_diff": rel, "tokens_identical_to_hf": first, "agree": agree,
                         "ttft_ms": r.ttft_ms, "bytes_streamed": streamed}
        tokens[name] = toks
        ok &= rel <= LOGIT_TOLERANCE and agree
        print(f"{name:13s} logits max|diff|/max|ref| {rel:.2e} (tolerance {LOGIT_TOLERANCE}); greedy identical to HF "
              f"for {first}/{len(ref_greedy)}{'' if first == len(ref_greedy) else ' (top-5 at divergence: ' + str(agree) + ')'}; "
              f"streamed {streamed} B")
    same = tokens["split_stream"] == tokens["split_cpu"]
    results["stream_equals_cpu_prefill_tokens"] = same
    print(f"split_stream tokens == split_cpu tokens: {same}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok and results["split_stream"]["bytes_streamed"] > 0 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--build", action="store_true", help="build the bundles and references into DIR (here)")
    ap.add_argument("--quant", default="", help="with --build: quantize the model (q8_0 | q4_0 | q4_k | q4_k_m)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.build:
        build(a.dir, a.quant)
        return 0
    return check(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
