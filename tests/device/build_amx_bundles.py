"""Build, on the compiler machine, the bundles tests/runtime/test_amx_prefill.py runs on an AMX CPU (the GPU
machine's Xeon): a bf16 model's CPU stage end to end against Hugging Face.

    python -m tests.device.build_amx_bundles .devrt/amx [--hardware PROFILE]

The AMX prefill GEMM takes bf16 weights' activations rounded to bf16 (the model's precision, as HF's bf16 linears)
unless built with the hi + lo split (gemm_amx.py); the 2-core CI machine has no AMX, so the GPU machine's CPU is where
that path meets a reference. Writes a tiny random-weight Qwen3 in bf16 (4 blocks, hidden 128) and two all-CPU
bundles for the profile's CPU features (default the measured H100 preset: AMX): `amx_model` (the default) and
`amx_split` (--prefill-activations fp32; both built without the artifact cache); plus DIR/refs.npz: transformers'
last-row prompt logits in fp32 and in bf16, and fp32 greedy tokens for a 40-token prompt. Carry DIR to the GPU
machine; the test looks in $HELMC_AMX_DIR (default .devrt/amx). Regenerate by running this again.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from helmc.errors import HelmcError
from helmc.hardware.profile import PRESET_DIR

PROMPT_LEN, NEW_TOKENS = 40, 24
BUNDLES = ("amx_model", "amx_split")


def build(out_dir: str, hardware: str) -> None:
    import torch

    from helmc.compiler.pipeline import build as build_bundle
    from helmc.hardware.profile import load_hardware
    from helmc.model.spec import ModelSpec
    from helmc.testing import hf_prompt_reference, make_tiny_model

    hw = load_hardware(hardware)
    if "amx_bf16" not in hw.cpu.features:
        raise HelmcError(f"expected a hardware profile whose CPU has amx_bf16; {hardware} has "
                         f"{', '.join(hw.cpu.features) or 'no features'}")
    model_dir = os.path.join(out_dir, "model")
    model = make_tiny_model(model_dir, "qwen3", num_layers=4, head_dim=32, dtype="bfloat16", seed=11,
                            hidden_size=128, intermediate_size=384).float()
    spec = ModelSpec.from_model_dir(model_dir)
    cpu_only = dataclasses.replace(hw, gpu=None, link=None)
    for name in BUNDLES:
        build_bundle(model_dir, cpu_only, os.path.join(out_dir, name), copy_weights=True, quiet=True,
                     use_cache=False, prefill_activations="fp32" if name == "amx_split" else "model")
    prompt = np.random.default_rng(5).integers(1, spec.vocab_size, PROMPT_LEN).tolist()
    logits, greedy = hf_prompt_reference(model, prompt, NEW_TOKENS)
    with torch.no_grad():
        logits_bf16 = model.to(torch.bfloat16)(torch.tensor([prompt])).logits[0, -1].float().numpy()
    np.savez(os.path.join(out_dir, "refs.npz"), prompt=np.array(prompt), logits=logits, logits_bf16=logits_bf16,
             greedy=greedy)
    print(f"wrote {', '.join(BUNDLES)} and refs.npz under {out_dir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hardware", default=os.path.join(PRESET_DIR, "h100-sxm-measured.json"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    try:
        build(a.out, a.hardware)
    except HelmcError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
