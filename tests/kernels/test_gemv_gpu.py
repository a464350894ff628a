"""The GPU stage's m-row decode GEMVs on the GPU at Qwen3-8B's projection shapes (batch invariance): for fp16 and bf16
weights and each quantized type, every row t of an m-row call (m = 2, 4, 8) is bit-identical to the 1-row kernel's y
on x[t] alone, and every call is within 2e-3 of float64 (2e-2 for the int8-activation GEMVs of q3_k / q4_k / q5_k /
q6_k); each one-launch form (q/k/v in one launch, gate/up + SwiGLU, down + residual add) gives every output
bit-identical to the separate launches it replaces. tests/kernels/test_gpu_gemv_kernels.py runs the same sources on
CPU threads; benchmarks/bench_gemv_gpu.py times them.

The kernels and data are built on the compiler machine by
    python -m tests.device.build_gemv_gpu_kernels .devrt/gemv_gpu_check
and carried to the GPU machine; the test looks in $HELMC_GEMV_GPU_DIR (default .devrt/gemv_gpu_check). Runs with the
runtime-only TVM (no compiler, no NVRTC).
"""
from __future__ import annotations

import pytest

from tests.device.build_quant_gpu_kernels import QTYPES
from tests.gpu_prebuilt import prebuilt_kernels

pytestmark = pytest.mark.gpu


def kernels() -> tuple:
    """(the loaded library, DIR, its manifest), or a skip naming what is missing."""
    return prebuilt_kernels("HELMC_GEMV_GPU_DIR", "gemv_gpu_check", "GEMV kernels", "build_gemv_gpu_kernels")


@pytest.mark.parametrize("dtype", ("float16", "bfloat16") + QTYPES)
def test_m_row_gemvs_are_their_single_rows_and_match_float64(dtype):
    from benchmarks.bench_gemv_gpu import run_group
    from benchmarks.bench_quant_gemv_gpu import untimed
    mod, d, manifest = kernels()
    groups: dict[tuple, list[dict]] = {}
    for e in manifest["kernels"]:
        if e["type"] == dtype:
            groups.setdefault((e["n"], e["k"]), []).append(e)
    if not groups:
        pytest.skip(f"{d} holds no {dtype} m-row kernels (built with --fused-only)")
    results = [r for (n, k), entries in groups.items() for r in run_group(mod, d, dtype, n, k, entries, untimed)]
    differ = [(r["n"], r["k"], r["m"]) for r in results if not r["bitwise"]]
    assert not differ, f"{dtype}: m-row calls whose rows differ from the 1-row kernel's (n, k, m): {differ}"
    failed = [(r["n"], r["k"], r["m"], r.get("variant"), r["max_rel_err"]) for r in results if not r["ok"]]
    assert not failed, f"{dtype}: beyond the tolerance (n, k, m, variant, error): {failed}"


def test_one_launch_forms_are_bit_identical_to_their_separate_launches():
    from benchmarks.bench_gemv_gpu import run_fused
    from benchmarks.bench_quant_gemv_gpu import untimed
    mod, d, manifest = kernels()
    if not manifest.get("fused"):
        pytest.skip(f"{d} holds no one-launch kernels")
    differ = [(r["kind"], r["type"], r["m"], r.get("tuning")) for r in run_fused(mod, d, manifest["fused"], untimed)
              if not r["bitwise"]]
    assert not differ, f"one-launch forms that differ from their separate launches (kind, type, m, tuning): {differ}"
