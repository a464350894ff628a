"""Build, on the compiler machine, the mixture-of-experts bundles tests/runtime/test_moe_gpu.py runs on the GPU.

    python -m tests.device.build_moe_gpu_bundles .devrt/moe_gpu [--hardware PROFILE] [--only NAME ...]

A tiny random Qwen3MoeForCausalLM (8 experts, top-2, normalised top-k, 3 blocks of which block 1 is dense; hidden
256, expert ffn 256: whole K-quant blocks) in fp16 and bf16, under DIR/model_float16 and DIR/model_bfloat16, and:
  gpu_float16   every block and the head on the GPU (experts on the CPU), batched decode variants for 4 sequences
  split_float16 cpu(2) -> cuda(3): block 0 on the CPU stage, blocks 1-2 on the GPU
  gpu_bfloat16  every block on the GPU, bf16 weights
  gpu_q4_k_m    every block on the GPU, --quant q4_k_m (the GGUF helmc wrote: DIR/model_float16-q4_k_m.gguf)
  gpu_q4_k_m_b8 the same with batched decode variants for 8 sequences (the m-row expert sums of batched steps)
for the GPU machine's profile (default the H200 preset, sm_90). Weights stay beside the bundles (not copied):
the test passes them with weights_dir. Carry DIR to the GPU machine.
"""
from __future__ import annotations

import os
import shutil
import time

from tests.device.forced_split import forced_split, main

DIMS = dict(num_layers=3, head_dim=64, hidden_size=256, moe_intermediate_size=256)
# bundle -> (model dtype, quant, CPU units (0: all on the GPU), batch)
BUNDLES = {"gpu_float16": ("float16", "", 0, 4), "split_float16": ("float16", "", 2, 1),
           "gpu_bfloat16": ("bfloat16", "", 0, 1), "gpu_q4_k_m": ("float16", "q4_k_m", 0, 1),
           "gpu_q4_k_m_b8": ("float16", "q4_k_m", 0, 8)}


def build(out_dir: str, hardware: str, only: tuple[str, ...] = ()) -> None:
    from helmc.compiler.pipeline import build as run_pipeline
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.compiler.read_model import read_model
    from helmc.hardware.profile import load_hardware
    from helmc.testing import make_tiny_model
    hw = load_hardware(hardware)
    cache = os.path.join(out_dir, ".cache")
    for name, (dtype, quant, cpu_units, batch) in BUNDLES.items():
        if only and name not in only:
            continue
        t0 = time.time()
        model = os.path.join(out_dir, f"model_{dtype}")
        if not os.path.isdir(model):
            make_tiny_model(model, "qwen3_moe", dtype=dtype, **DIMS)
        spec = read_model(model, quant, os.path.join(cache, "weights")).spec
        plan = forced_split(spec, hw, cpu_units, batch)
        bundle = os.path.join(out_dir, name)
        shutil.rmtree(bundle, ignore_errors=True)
        r = run_pipeline(model, hw, bundle, plan=plan, quant=quant, batch=batch, cache_dir=cache, quiet=True)
        if quant:
            shutil.copyfile(quantize_checkpoint(model, quant, os.path.join(cache, "weights")),
                            os.path.join(out_dir, f"model_{dtype}-{quant}.gguf"))
        print(f"built {bundle}: {r.plan.describe()} in {time.time() - t0:.1f} s")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main(__doc__, BUNDLES, build)
