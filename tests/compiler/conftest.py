"""Fixtures of the compiler tests: the quantized tiny GPU stage compiled to an sm_90 cubin once (nvcc takes tens of
seconds) for the tests that read its files."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def quantized_gpu_stage_files(tmp_path_factory):
    """(out dir, file names) of compile_gpu_stage on gpu_stage_specs' Q4_K_M-like stage with batched decode."""
    pytest.importorskip("tvm.relax")
    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage, find_nvcc
    from gpu_stage_specs import imported_gpu_stage
    if find_nvcc() is None:
        pytest.skip("needs nvcc")
    mod, weight_types = imported_gpu_stage("float16", True)
    out = tmp_path_factory.mktemp("quantized-gpu-stage")
    return out, compile_gpu_stage(mod, "sm_90", str(out), weight_types=weight_types)
