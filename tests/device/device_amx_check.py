#!/usr/bin/env python3
"""Check a bf16 model's CPU stage end to end on an AMX CPU (the GPU machine's Xeon) against Hugging Face.

The AMX prefill GEMM takes bf16 weights' activations rounded to bf16 (the model's precision, as HF's bf16
linears) unless built with the hi + lo split (gemm_amx.py); the 2-core CI machine has no AMX, so this is
where that path meets a reference.

  --build DIR   (here, compiler venv) writes a tiny random-weight Qwen3 in bf16 (4 blocks, hidden 128) and two
      all-CPU bundles for the measured H100 machine's CPU features (AMX): `amx_model` (the default) and
      `amx_split` (--prefill-activations fp32; both built without the artifact cache); plus DIR/refs.npz: HF
      transformers' last-row prompt logits in fp32 and in bf16, and fp32 greedy tokens for a 40-token prompt.
      Regenerate by running --build again.
  DIR [--out FILE]   (AMX machine, runtime-only TVM) runs each bundle's prompt (a 40-token prefill: the AMX
      GEMMs) and compares the logits with both references (max |diff| / max |ref|) and its greedy tokens with
      HF's (identical, or HF's token in helmc's top-5 at the first divergence). Exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

PROMPT_LEN, NEW_TOKENS = 40, 24
LOGIT_TOLERANCE = 2e-2          # against the fp32 reference; HF's own bf16 model is printed beside it
BUNDLES = ("amx_model", "amx_split")


def build(out_dir: str) -> None:
    import torch

    from helmc.hardware.profile import load_hardware
    from helmc.model.spec import ModelSpec
    from helmc.compiler.pipeline import build as build_bundle
    from helmc.testing import hf_prompt_reference, make_tiny_model

    model_dir = os.path.join(out_dir, "model")
    model = make_tiny_model(model_dir, "qwen3", num_layers=4, head_dim=32, dtype="bfloat16", seed=11,
                            hidden_size=128, intermediate_size=384).float()
    spec = ModelSpec.from_model_dir(model_dir)
    hw = load_hardware(os.path.join(_ROOT, "helmc/hardware/presets/h100-sxm-measured.json"))
    assert "amx_bf16" in hw.cpu.features, "the check needs a hardware profile with AMX"
    cpu_only = dataclasses.replace(hw, gpu=None, link=None)
    for name in BUNDLES:
        build_bundle(model_dir, cpu_only, os.path.join(out_dir, name), copy_weights=True, quiet=True,
                     use_cache=False, prefill_activations="fp32" if name == "amx_split" else "model")
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, spec.vocab_size, PROMPT_LEN).tolist()
    logits, greedy = hf_prompt_reference(model, prompt, NEW_TOKENS)
    with torch.no_grad():
        logits_bf16 = model.to(torch.bfloat16)(torch.tensor([prompt])).logits[0, -1].float().numpy()
    np.savez(os.path.join(out_dir, "refs.npz"), prompt=np.array(prompt), logits=logits, logits_bf16=logits_bf16,
             greedy=greedy)
    print(f"wrote {', '.join(BUNDLES)} and refs.npz under {out_dir}")


def check(dir_: str, out_path: str | None) -> int:
    from device_prefill_check import compare_with_hf
    from helmc.runtime.session import Session

    refs = np.load(os.path.join(dir_, "refs.npz"))
    prompt, ref, ref_bf16, ref_greedy = (refs["prompt"].tolist(), refs["logits"], refs["logits_bf16"],
                                         refs["greedy"].tolist())
    hf_bf16_rel = float(np.abs(ref_bf16 - ref).max() / np.abs(ref).max())
    results, ok = {"hf_bf16_vs_fp32_logits_rel_diff": hf_bf16_rel}, True
    for name in BUNDLES:
        logits, rel, _, agree, first = compare_with_hf(Session.load(os.path.join(dir_, name)), prompt, ref,
                                                        ref_greedy, NEW_TOKENS)
        rel_bf16 = float(np.abs(logits - ref_bf16).max() / np.abs(ref).max())
        results[name] = {"logits_rel_diff": rel, "logits_rel_diff_vs_hf_bf16": rel_bf16,
                         "tokens_identical_to_hf": first, "agree": agree}
        ok &= rel <= LOGIT_TOLERANCE and agree
        print(f"{name:10s} logits max|diff|/max|ref| vs HF fp32 {rel:.2e} (tolerance {LOGIT_TOLERANCE}), vs HF bf16 "
              f"{rel_bf16:.2e}; greedy identical to HF fp32 for {first}/{len(ref_greedy)}"
              f"{'' if first == len(ref_greedy) else ' (top-5 at divergence: ' + str(agree) + ')'}")
    print(f"HF's own bf16 model vs its fp32: {hf_bf16_rel:.2e}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--build", action="store_true", help="build the bundles and references into DIR (here)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.build:
        build(a.dir)
        return 0
    return check(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
