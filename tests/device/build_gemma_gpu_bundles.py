"""Build, on the compiler machine, the bundles tests/runtime/test_gemma_gpu.py runs on the GPU: Gemma 3's blocks on
the GPU stage against Hugging Face references made here.

    python -m tests.device.build_gemma_gpu_bundles .devrt/gemma3_gpu [--hardware PROFILE]

A tiny random-weight Gemma 3 (fp16, 6 blocks: sliding, sliding, global, ...; window 8, its own RoPE base beside the
global blocks' linear-scaled one; head_dim 256 and two query heads per KV head, as Gemma-3-12B's, so the decode
kernels and flash_prefill run at that head size) and four bundles with fixed plans for the GPU machine's profile
(default the measured H100 preset, sm_90), each prefilling in chunks of 16 tokens:

    all_gpu    every block and the head on the GPU
    split      blocks 0-1 on the CPU, 2-5 on the GPU
    streamed   blocks 0-2 host-resident (2 global), their prefill streamed to the GPU; 3-5 on the GPU
    hybrid     C0 [0] S0 [1, 2] C1 [3] S1 [4] | resident [5]: streamed blocks sliding (1, 4) and global (2)

plus DIR/refs.npz: transformers' fp32 last-row prompt logits and greedy tokens for a 40-token prompt (five windows:
a wrong window or RoPE table diverges).
Carry DIR to the GPU machine; the test looks in $HELMC_GEMMA_GPU_DIR (default .devrt/gemma3_gpu).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from helmc.hardware.profile import PRESET_DIR

PROMPT_LEN, NEW_TOKENS, CHUNK = 40, 24, 16
BUNDLES = ("all_gpu", "split", "streamed", "hybrid")
SHAPE = dict(head_dim=256, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def build(out_dir: str, hardware: str) -> None:
    from helmc.compiler.pipeline import build as build_bundle
    from helmc.hardware.profile import load_hardware
    from helmc.model.load import load_spec
    from helmc.planner.hybrid import forced_layout, forced_split
    from helmc.runtime.bundle.plan import Plan
    from helmc.testing import hf_prompt_reference, make_tiny_model

    t0 = time.time()
    model_dir = os.path.join(out_dir, "model")
    model = make_tiny_model(model_dir, "gemma3", num_layers=6, dtype="float16", seed=11, **SHAPE).float().eval()
    spec = load_spec(model_dir)
    hw = load_hardware(hardware)
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, spec.vocab_size, PROMPT_LEN).tolist()
    common = dict(num_layers=spec.num_layers, max_context=512, prefill_chunk_tokens=CHUNK, gpu_kv_pool_bytes=64 << 20)
    base = Plan.of(cpu_units=0, **common)
    plans = {"all_gpu": base, "split": Plan.of(cpu_units=3, **common), "streamed": forced_split(base, spec, 4),
             "hybrid": forced_layout(base, spec, ((1, 2), (1, 1)))}
    for name, plan in plans.items():
        r = build_bundle(model_dir, hw, os.path.join(out_dir, name), plan=plan, copy_weights=True, quiet=True)
        print(f"  {name}: {r.plan.describe()}{', prefill streamed' if r.plan.placement.prefill_on_gpu else ''}")
    logits, greedy = hf_prompt_reference(model, prompt, NEW_TOKENS)
    np.savez(os.path.join(out_dir, "refs.npz"), prompt=np.array(prompt), logits=logits, greedy=greedy)
    print(f"wrote {', '.join(BUNDLES)} and refs.npz under {out_dir} in {time.time() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hardware", default=os.path.join(PRESET_DIR, "h100-sxm-measured.json"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    build(a.out, a.hardware)


if __name__ == "__main__":
    main()
