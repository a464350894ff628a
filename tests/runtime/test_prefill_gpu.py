"""The GPU-side prefill paths end to end on the GPU machine against Hugging Face: a tiny Qwen3 whose CPU blocks'
prefill streams to the GPU (`split_stream`), the same split prefilling them on the CPU (`split_cpu`) and every block
on the GPU (`all_gpu`), each with prefill chunks of 8 tokens, in fp16 and from a q4_k_m GGUF file.

The bundles and references are built on the compiler machine by
    python -m tests.device.build_prefill_bundles .devrt/prefill
    python -m tests.device.build_prefill_bundles .devrt/prefill_q4_k_m --quant q4_k_m
and carried to the GPU machine; the tests look in $HELMC_GPU_PREFILL_DIR and $HELMC_GPU_PREFILL_QUANT_DIR (defaults
.devrt/prefill and .devrt/prefill_q4_k_m). Pass: the prompt's last logits within 2e-2 of transformers' fp32
(max |diff| / max |ref|: fp16 activations on the GPU), the greedy tokens identical or, at the first divergence,
transformers' token in helmc's top 5; split_stream streamed its host blocks' weights to the GPU.
Imports no compiler: it runs with the runtime-only TVM (TVM_USE_RUNTIME_LIB=1).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu_prebuilt import prebuilt_dir

pytestmark = pytest.mark.gpu

DIRS = {"float16": ("HELMC_GPU_PREFILL_DIR", "prefill", ""),
        "q4_k_m": ("HELMC_GPU_PREFILL_QUANT_DIR", "prefill_q4_k_m", " --quant q4_k_m")}
LOGIT_TOLERANCE = 2e-2          # fp16 activations on the GPU against an fp32 reference
NEW_TOKENS = 24


def prefill_dir(weights: str) -> str:
    env, default, flag = DIRS[weights]
    return prebuilt_dir(env, default, "refs.npz", "prefill test bundles",
                        f"build_prefill_bundles .devrt/{default}{flag}")


@pytest.mark.parametrize("weights", sorted(DIRS))
@pytest.mark.parametrize("name", ["split_stream", "split_cpu", "all_gpu"])
def test_prefill_matches_transformers(name, weights):
    from helmc.runtime.session import Session
    from tests.hf_checks import compare_with_hf
    d = prefill_dir(weights)
    refs = np.load(os.path.join(d, "refs.npz"))
    prompt, ref_greedy = refs["prompt"].tolist(), refs["greedy"].tolist()
    s = Session.load(os.path.join(d, name))
    _, rel, r, agree, first = compare_with_hf(s, prompt, refs["logits"], ref_greedy, NEW_TOKENS)
    streamed = s.gpu.streamed_prefill.bytes_streamed if s.gpu.streamed_prefill is not None else 0
    print(f"\n{weights} {name}: logits max|diff|/max|ref| {rel:.2e}; greedy identical to HF for {first}/"
          f"{len(ref_greedy)}; TTFT {r.ttft_ms:.1f} ms; streamed {streamed} B")
    assert rel <= LOGIT_TOLERANCE, (name, rel)
    assert agree, f"{name}: HF's token {ref_greedy[first]} not in helmc's top 5 at its first divergence ({first})"
    if name == "split_stream":
        assert streamed > 0, "split_stream's prompt streamed nothing to the GPU"
