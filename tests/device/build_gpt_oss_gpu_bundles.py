"""Build, on the compiler machine, the gpt-oss bundles tests/runtime/test_gpt_oss_gpu.py runs on the GPU.

    python -m tests.device.build_gpt_oss_gpu_bundles .devrt/gpt_oss_gpu [--hardware PROFILE] [--only NAME ...]

A tiny random GptOssForCausalLM (4 blocks, window 8 on blocks 0 and 2, YaRN, 8 experts, top-3, the router and the
experts biased, the clamped SwiGLU; hidden 128, expert ffn 64: whole MXFP4 blocks) as DIR/model_float16 (HF, fp16,
swiglu_limit 0.5 so the clamp acts), and DIR/model_gguf (HF, fp32, llama.cpp's YaRN ramp and fixed limit 7) written
as DIR/gpt-oss-mxfp4.gguf (MXFP4 experts, Q8_0 attention and head, F16 embedding: llama.cpp's gpt-oss mix), and:
  gpu_float16   every block and the head on the GPU (experts on the CPU), batched decode variants for 4 sequences
  split_float16 cpu(2) -> cuda(4): block 0 on the CPU stage, blocks 1-3 on the GPU
  gpu_mxfp4     every block on the GPU from the GGUF, batched decode variants for 4 sequences (the CPU's biased
                one-call and m-row expert sums for host experts; VRAM experts' decode rows on the GPU's biased
                two-launch expert kernels, a prompt's through the MXFP4 GEMV per expert)
for the GPU machine's profile (default the H200 preset, sm_90). Weights stay beside the bundles (not copied):
the test passes them with weights_dir. Carry DIR to the GPU machine.
"""
from __future__ import annotations

import os
import shutil
import time

from tests.device.forced_split import forced_split, main

DIMS = dict(num_layers=4, hidden_size=128, intermediate_size=64)
# llama.cpp runs YaRN with the ramp's ends rounded (truncate) and the clamp at 7: a GGUF has no key for either
GGUF_MODEL = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": True},
                  swiglu_limit=7.0)
GGUF = "gpt-oss-mxfp4.gguf"
# bundle -> (source: an HF directory under DIR or the GGUF, CPU units (0: all on the GPU), batch)
BUNDLES = {"gpu_float16": ("model_float16", 0, 4), "split_float16": ("model_float16", 2, 1),
           "gpu_mxfp4": (GGUF, 0, 4)}


def sources(out_dir: str) -> None:
    """The HF directories and the GGUF, made once."""
    from helmc.testing import make_tiny_model, write_gpt_oss_gguf
    model = os.path.join(out_dir, "model_float16")
    if not os.path.isdir(model):
        make_tiny_model(model, "gpt_oss", dtype="float16", **DIMS)
    model = os.path.join(out_dir, "model_gguf")
    if not os.path.isdir(model):
        make_tiny_model(model, "gpt_oss", dtype="float32", **DIMS, **GGUF_MODEL)
    if not os.path.isfile(os.path.join(out_dir, GGUF)):
        write_gpt_oss_gguf(model, os.path.join(out_dir, GGUF), experts="mxfp4", linears="q8_0", embed="f16")


def build(out_dir: str, hardware: str, only: tuple[str, ...] = ()) -> None:
    from helmc.compiler.pipeline import build as run_pipeline
    from helmc.compiler.read_model import read_model
    from helmc.hardware.profile import load_hardware
    hw = load_hardware(hardware)
    cache = os.path.join(out_dir, ".cache")
    sources(out_dir)
    for name, (source, cpu_units, batch) in BUNDLES.items():
        if only and name not in only:
            continue
        t0 = time.time()
        model = os.path.join(out_dir, source)
        spec = read_model(model).spec
        plan = forced_split(spec, hw, cpu_units, batch)
        bundle = os.path.join(out_dir, name)
        shutil.rmtree(bundle, ignore_errors=True)
        r = run_pipeline(model, hw, bundle, plan=plan, batch=batch, cache_dir=cache, quiet=True)
        print(f"built {bundle}: {r.plan.describe()} in {time.time() - t0:.1f} s")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main(__doc__, BUNDLES, build)
