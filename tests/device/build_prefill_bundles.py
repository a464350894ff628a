"""Build, on the compiler machine, the bundles tests/runtime/test_prefill_gpu.py runs on the GPU: the GPU-side
prefill paths against Hugging Face references made here.

    python -m tests.device.build_prefill_bundles .devrt/prefill [--hardware PROFILE]
    python -m tests.device.build_prefill_bundles .devrt/prefill_q4_k_m --quant q4_k_m

A tiny random-weight Qwen3 (fp16, 4 blocks) and three bundles with fixed plans for the GPU machine's profile (default
the measured H100 preset, sm_90): `split_stream` (the CPU's blocks' prefill streamed to the GPU, chunks of 8
tokens), `split_cpu` (the same split, the prefill of those blocks on the CPU) and `all_gpu` (chunks of 8); plus
DIR/refs.npz: transformers' fp32 last-row prompt logits and greedy tokens for a 40-token prompt.
With --quant (q8_0 | q4_0 | q4_k | q4_k_m): a tiny Qwen3 (hidden 256, ffn 512) quantized to a GGUF file (helmc's
quantize-at-build; q4_k_m mixes Q4_K and Q6_K: two block signatures), the bundles built from that file, the
references from transformers in fp32 on the gguf package's dequantization of the same file. Carry DIR to the GPU
machine; the test looks in $HELMC_GPU_PREFILL_DIR and $HELMC_GPU_PREFILL_QUANT_DIR (defaults .devrt/prefill and
.devrt/prefill_q4_k_m). Regenerate by running this again.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from helmc.hardware.profile import PRESET_DIR

PROMPT_LEN, NEW_TOKENS, CHUNK = 40, 24, 8
BUNDLES = ("split_stream", "split_cpu", "all_gpu")


def build(out_dir: str, hardware: str, quant: str = "") -> None:
    from helmc.compiler.pipeline import build as build_bundle
    from helmc.hardware.profile import load_hardware
    from helmc.model.load import load_spec
    from helmc.runtime.bundle.plan import Plan
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
    hw = load_hardware(hardware)
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, spec.vocab_size, PROMPT_LEN).tolist()
    common = dict(num_layers=spec.num_layers, max_context=512)
    plans = {
        "split_stream": Plan.of(cpu_units=3, prefill_on_gpu=True, prefill_chunk_tokens=CHUNK, prefill_staging_bytes=1,
                             gpu_kv_pool_bytes=64 << 20, **common),
        "split_cpu": Plan.of(cpu_units=3, prefill_chunk_tokens=CHUNK, gpu_kv_pool_bytes=64 << 20, **common),
        "all_gpu": Plan.of(cpu_units=0, prefill_chunk_tokens=CHUNK, gpu_kv_pool_bytes=64 << 20, **common),
    }
    for name, plan in plans.items():
        build_bundle(source, hw, os.path.join(out_dir, name), plan=plan, copy_weights=True, quiet=True)
    logits, greedy = hf_prompt_reference(model, prompt, NEW_TOKENS)
    np.savez(os.path.join(out_dir, "refs.npz"), prompt=np.array(prompt), logits=logits, greedy=greedy)
    print(f"wrote {', '.join(BUNDLES)} and refs.npz under {out_dir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hardware", default=os.path.join(PRESET_DIR, "h100-sxm-measured.json"))
    ap.add_argument("--quant", default="", help="quantize the model (q8_0 | q4_0 | q4_k | q4_k_m)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    build(a.out, a.hardware, a.quant)


if __name__ == "__main__":
    main()
