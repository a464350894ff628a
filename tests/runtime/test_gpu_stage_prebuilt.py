"""A GPU stage prebuilt on the compiler machine, loaded on the GPU machine by helmc.runtime.cuda_runtime with the
runtime-only TVM (no compiler, no NVRTC), against torch in fp32 over the same inputs; and the weight upload path.

The stage (a tiny Qwen3's pre-attention, post-attention and head functions, decode and prefill, exactly as helmc
builds them, plus two GEMV / GEMM probes at Qwen3-8B's MLP shape) and its references are built by
    python -m tests.device.build_gpu_stage .devrt/gpu_stage_check
and carried to the GPU machine; the tests look in $HELMC_GPU_STAGE_DIR (default .devrt/gpu_stage_check).
Pass: every output finite, of the reference's shape and within 1e-2 of it (max |diff| / max |ref|: the stage keeps
activations in fp16); the probes within 1e-2 of CuPy's fp32 product of the same fp16 inputs; PinnedUploader's
copy through its two pinned staging buffers bit-exact, as a bfloat16 TVM tensor. benchmarks/bench_gpu_stage_probes.py
times the probes and the upload.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu_prebuilt import cuda_device, prebuilt_dir

pytestmark = pytest.mark.gpu

FUNCS = ("pre_attn_decode", "pre_attn_prefill", "post_attn_decode", "post_attn_prefill", "head_decode", "head_prefill")
TOLERANCE = 1e-2
_VM: dict = {}


def stage() -> tuple:
    """(the loaded stage's VM, its refs.npz), or a skip naming how to build them."""
    path = prebuilt_dir("HELMC_GPU_STAGE_DIR", "gpu_stage_check", "refs.npz", "prebuilt GPU stage",
                        "build_gpu_stage .devrt/gpu_stage_check")
    if path not in _VM:
        from helmc.runtime.cuda_runtime import load_gpu_vm
        _VM[path] = (load_gpu_vm(os.path.join(path, "check_stage.so"), os.path.join(path, "check_stage.cubins.json")),
                     np.load(os.path.join(path, "refs.npz")))
    return _VM[path]


@pytest.mark.parametrize("name", FUNCS)
def test_stage_function_matches_torch_fp32(name):
    vm, refs = stage()
    import cupy as cp
    import tvm.runtime

    from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_to_cupy
    n_in = sum(1 for k in refs.files if k.startswith(f"{name}/in"))
    n_out = sum(1 for k in refs.files if k.startswith(f"{name}/out"))
    assert n_in and n_out, f"refs.npz has no inputs or outputs of {name}"
    outs = vm[name](*(cupy_to_tvm(cp.asarray(refs[f"{name}/in{i}"])) for i in range(n_in)))
    outs = [outs] if isinstance(outs, tvm.runtime.Tensor) else list(outs)       # a tuple comes as an Array
    for i in range(n_out):
        got, ref = cp.asnumpy(tvm_to_cupy(outs[i])), refs[f"{name}/out{i}"]
        assert got.shape == ref.shape and np.isfinite(got).all(), (name, i, got.shape, ref.shape)
        rel = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
        print(f"\n{name} out{i} {got.shape}: max|diff|/max|ref| = {rel:.2e}")
        assert rel < TOLERANCE, (name, i, rel)


@pytest.mark.parametrize("name,seq", [("probe_gemv", 1), ("probe_prefill", 128)])
def test_probe_matches_cupy(name, seq):
    vm, _ = stage()
    cp = cuda_device()
    from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_to_cupy
    rs = cp.random.RandomState(0)
    w = cupy_to_tvm((rs.standard_normal((12288, 4096), dtype=cp.float32) * 0.02).astype(cp.float16))
    x = cupy_to_tvm(rs.standard_normal((seq, 4096), dtype=cp.float32).astype(cp.float16))
    ref = cp.asnumpy(tvm_to_cupy(x).astype(cp.float32) @ tvm_to_cupy(w).astype(cp.float32).T)
    got = cp.asnumpy(tvm_to_cupy(vm[name](x, w))).astype(np.float32)
    rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    assert rel < TOLERANCE, (name, rel)


def test_pinned_upload_is_bit_exact_as_bfloat16():
    """160 MiB of raw bf16 bits through two 64 MiB staging buffers: each buffer refilled after its copy."""
    cp = cuda_device()
    from helmc.runtime.cuda_runtime import PinnedUploader, tvm_to_cupy
    host = np.random.default_rng(1).integers(0, 1 << 16, size=(80 << 20,), dtype=np.uint16)
    up = PinnedUploader()
    t = up.upload(host.reshape(-1, 1 << 14), dtype="bfloat16")
    up.synchronize()
    assert str(t.dtype) == "bfloat16"
    assert bool(cp.array_equal(tvm_to_cupy(t).reshape(-1), cp.asarray(host)))
