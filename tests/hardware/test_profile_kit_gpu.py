"""The profile kit's GPU decode GEMVs (M on the GPU per weight type, from helmc's own kernels).

- build_gpu_gemv_kernels (gpu_gemv_funcs) compiles, for a GPU arch, one block's GEMVs per weight type in the GPU stage's launch
  forms (q/k/v one launch, SwiGLU and residual epilogues for fp16 / bf16 / q4_k / q6_k; q8_0 / q4_0 per linear);
- measure_gpu_gemv's launches pass every kernel arguments of the shapes and dtypes its PrimFunc declares (checked
  here against the PrimFuncs themselves, with NumPy arrays standing in for device memory: nothing runs);
- a kit refuses GPU kernels in roles their type does not have.
Compiled to a cubin, they are checked in a whole kit built for another machine's GPU
(tests/planner/test_cli_plan.py::test_kit_for_another_cpu_reports_its_phases).
The GPU machine's `pytest -m gpu tests/hardware/test_profile_hardware.py` times them (gpu.gemv_reads).
"""
import dataclasses
import functools

import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.hardware.kit import (FLOAT_TYPES, GPU_FUSED_TYPES, KIT_FORMAT_VERSION, QUANT_TYPES, QUICK_BLOCK, KitKernel,
                                ProfileKit)

tvm = pytest.importorskip("tvm")


@functools.lru_cache(maxsize=None)
def _primfuncs(block):
    """gpu_gemv_funcs, made once per block shape for the tests that read them (building the PrimFuncs takes
    seconds; nothing edits them)."""
    from helmc.compiler.profile_kit import gpu_gemv_funcs
    return gpu_gemv_funcs(block)


class _Shim:
    """NumPy in CuPy's place for what _launches allocates."""
    float16, uint16, uint8 = np.float16, np.uint16, np.uint8

    class random:
        @staticmethod
        def randint(lo, hi, shape, dtype):
            return np.zeros(shape, dtype)

    @staticmethod
    def full(shape, value, dtype):
        return np.full(shape, value, dtype)

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)


def test_kit_gpu_gemvs_cover_every_type_in_the_stage_launch_forms():
    funcs, kernels = _primfuncs(QUICK_BLOCK)
    for t in GPU_FUSED_TYPES:
        assert [k.role for k in kernels if k.weight_type == t] == ["qkv", "o", "swiglu", "down"], t
    for t in set(QUANT_TYPES) - set(GPU_FUSED_TYPES):
        assert [k.role for k in kernels if k.weight_type == t] == ["q", "k", "v", "o", "gate", "up", "down"], t
    names = {k.name for k in kernels}
    assert names == set(funcs) and any("swiglu_q4_k" in n for n in names) and any("res_q6_k" in n for n in names)


def test_measurement_launches_match_the_kernels_signatures():
    """Every launch _launches makes passes arrays whose shapes and dtypes are the PrimFunc's buffers'."""
    from helmc.hardware.measure_gpu_gemv import _launches, block_weight_bytes
    funcs, kernels = _primfuncs(QUICK_BLOCK)
    kit = _kit(kernels)
    calls = []

    class Mod(dict):
        def __getitem__(self, name):
            f = funcs[name]

            def launch(*args):
                want = [(tuple(int(d) for d in p.ty.shape), str(p.ty.dtype)) for p in f.params]
                got = [(a.shape, dtype or str(a.dtype)) for a, dtype in args]
                assert got == want, (name, got, want)
                calls.append(name)
            return launch
    for t in FLOAT_TYPES + QUANT_TYPES:
        block, weights, nbytes = _launches(_Shim, lambda a, dtype=None: (a, dtype), kit, Mod(), t)
        assert len(weights) >= 2 and nbytes == block_weight_bytes(kit, t)
        assert nbytes == sum(a.nbytes for a, _ in weights[0].values())             # the block's weights, as stored
        calls.clear()
        block(weights[1])
        assert calls == [k.name for k in kernels if k.weight_type == t], (t, calls)


def _kit(kernels, **kw):
    return ProfileKit(format_version=KIT_FORMAT_VERSION, isa="avx2", required_flags=(), l3_bytes=1 << 25, cores=2, block=QUICK_BLOCK,
                      read_elements=1, l3_read_elements=1, read_name="r", l3_read_name="r3", kernels=(),
                      gemm_name="g", gpu_bundle="gpu_bundle", gpu_arch="sm_90", gpu_gemv_kernels=tuple(kernels), **kw)


def test_kit_refuses_gpu_kernels_in_other_roles():
    with pytest.raises(HelmcError, match="GPU kernel k8 expected one row and a role of 'q8_0'"):
        _kit([KitKernel("q8_0", "qkv", "k8")])
    with pytest.raises(HelmcError, match="role of 'q4_k'"):
        _kit([KitKernel("q4_k", "gate", "k4")])
    with pytest.raises(HelmcError, match="GPU GEMV kernels expected with a gpu_arch"):
        dataclasses.replace(_kit([KitKernel("float16", "o", "f")]), gpu_bundle="", gpu_arch="")
    assert _kit([KitKernel("float16", "o", "f")]).gpu_gemv_roles("float16") == {"o": "f"}
