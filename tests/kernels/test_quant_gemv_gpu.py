"""The quantized-weight CUDA kernels (schedules/gpu/quant_gemv.py, quant_gemv_int8.py) on the GPU at Qwen3-8B's
projection shapes, against float64 on gguf's own dequantization of the same rows: each type's decode GEMV (at its
default and other tunings), its dequantizer (rows element by element and their product with x), and the
int8-activation GEMV of q3_k / q4_k / q5_k / q6_k. Pass: max |y - ref| / max |ref| <= 2e-3 (2e-2 for int8
activations: their own ~0.5%); the builder's docstring gives the reasoning. tests/kernels/test_gpu_quant_kernels.py runs the same sources
on CPU threads at small shapes; benchmarks/bench_quant_gemv_gpu.py times them.

The kernels and data are built on the compiler machine by
    python -m tests.device.build_quant_gpu_kernels .devrt/quant_gpu_check
and carried to the GPU machine; the test looks in $HELMC_QUANT_GPU_DIR (default .devrt/quant_gpu_check). Runs with
the runtime-only TVM (no compiler, no NVRTC).
"""
from __future__ import annotations

import pytest

from tests.device.build_quant_gpu_kernels import QTYPES
from tests.gpu_prebuilt import prebuilt_kernels

pytestmark = pytest.mark.gpu


def kernels() -> tuple:
    """(the loaded library, DIR, its manifest), or a skip naming what is missing."""
    return prebuilt_kernels("HELMC_QUANT_GPU_DIR", "quant_gpu_check", "quantized GPU kernels",
                            "build_quant_gpu_kernels")


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_kernels_match_float64(qtype):
    from benchmarks.bench_quant_gemv_gpu import run_group, untimed
    mod, d, manifest = kernels()
    groups: dict[tuple, list[dict]] = {}
    for e in manifest["kernels"]:
        if e["qtype"] == qtype:
            groups.setdefault((e["n"], e["k"]), []).append(e)
    assert groups, f"the manifest has no {qtype} kernels"
    from helmc.model.weight_types import GPU_INT8_TYPES     # the registry: no TVM compiler on the GPU machine
    if qtype in GPU_INT8_TYPES:      # a DIR built before the type had its int8 GEMV would check only the fp32 path
        assert any(e["kind"] == "gemv8" for es in groups.values() for e in es), \
            f"the manifest has no {qtype} int8 GEMV: rebuild it with build_quant_gpu_kernels"
    failed = [(r["kind"], r["n"], r["k"], r["tuning"], r["max_rel_err"])
              for (n, k), entries in groups.items()
              for r in run_group(mod, d, manifest, qtype, n, k, entries, untimed) if not r["ok"]]
    assert not failed, f"{qtype}: kernels beyond their tolerance (kind, n, k, tuning, error): {failed}"
