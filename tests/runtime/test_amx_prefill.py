"""A bf16 model's CPU stage end to end on an AMX CPU (the GPU machine's Xeon) against Hugging Face: the AMX prefill
GEMM with activations rounded to bf16 (`amx_model`, the default) and with the hi + lo split (`amx_split`,
--prefill-activations fp32). The 2-core CI machine has no AMX, so the GPU machine's CPU is where that path meets a
reference; the test runs with the GPU tests (-m gpu) and skips on a CPU without amx_bf16.

The bundles and references are built on the compiler machine by
    python -m tests.device.build_amx_bundles .devrt/amx
and carried to the GPU machine; the test looks in $HELMC_AMX_DIR (default .devrt/amx). Pass: a 40-token prompt's
last logits within 2e-2 of transformers' fp32 (max |diff| / max |ref|; HF's own bf16 model is printed beside it),
and the greedy tokens identical or, at the first divergence, transformers' token in helmc's top 5.
Imports no compiler: it runs with the runtime-only TVM.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu_prebuilt import prebuilt_dir

pytestmark = pytest.mark.gpu

LOGIT_TOLERANCE = 2e-2
NEW_TOKENS = 24


def amx_dir() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            amx = any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        amx = False
    if not amx:
        pytest.skip("this CPU has no amx_bf16")
    return prebuilt_dir("HELMC_AMX_DIR", "amx", "refs.npz", "AMX test bundles", "build_amx_bundles .devrt/amx",
                        needs_gpu=False)


@pytest.mark.parametrize("name", ["amx_model", "amx_split"])
def test_amx_prefill_matches_transformers(name):
    from helmc.runtime.session import Session
    from tests.hf_checks import compare_with_hf
    d = amx_dir()
    refs = np.load(os.path.join(d, "refs.npz"))
    prompt, ref, ref_bf16, ref_greedy = (refs["prompt"].tolist(), refs["logits"], refs["logits_bf16"],
                                         refs["greedy"].tolist())
    logits, rel, _, agree, first = compare_with_hf(Session.load(os.path.join(d, name)), prompt, ref, ref_greedy,
                                                    NEW_TOKENS)
    rel_bf16 = float(np.abs(logits - ref_bf16).max() / np.abs(ref).max())
    hf_bf16 = float(np.abs(ref_bf16 - ref).max() / np.abs(ref).max())
    print(f"\n{name}: logits max|diff|/max|ref| vs HF fp32 {rel:.2e}, vs HF bf16 {rel_bf16:.2e} (HF's bf16 vs its "
          f"fp32: {hf_bf16:.2e}); greedy identical to HF fp32 for {first}/{len(ref_greedy)}")
    assert rel <= LOGIT_TOLERANCE, (name, rel)
    assert agree, f"{name}: HF's token {ref_greedy[first]} not in helmc's top 5 at its first divergence ({first})"
