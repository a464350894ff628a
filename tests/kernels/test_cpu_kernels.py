"""CPU-stage kernels (schedules/cpu) against NumPy float64 on random inputs.

Odd shapes on purpose: K=4099 and K=3 are not multiples of any vector width, N=37 is not a multiple of the
GEMM's row tile, 5 and 9 tokens not multiples of its token tile. Tolerance: relative error (max |diff| over
max |ref|) <= 1e-3 for fp16/bf16 weights, as the issue asks; the kernels accumulate in fp32, so they land
near 1e-6. No stored references: NumPy recomputes them on every run.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from helmc.runtime.tvm_tensors import (bf16_bits_from_float32, float32_from_bf16_bits, numpy_from_tensor,  # noqa: E402
                                       tensor_from_numpy)
from helmc.compiler.passes.schedule_cpu_stage import llvm_target, required_cpu_features  # noqa: E402
from helmc.schedules.cpu.gemm import GemmTiling, make_gemm  # noqa: E402
from helmc.schedules.cpu.gemv import make_gemv  # noqa: E402
from helmc.schedules.cpu.isa import missing_flags, select_isa  # noqa: E402
from helmc.runtime.bundle.manifest import host_cpu_flags  # noqa: E402

AVX2 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
SPR = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_fp16", "amx_tile")



needs_avx2 = pytest.mark.skipif(missing_flags(AVX2, host_cpu_flags()) != (), reason="this CPU lacks AVX2/FMA/F16C")


def random_weight(rng, n, k, dtype):
    """(tensor, float64 copy of exactly what the kernel reads)."""
    vals = rng.standard_normal((n, k), dtype=np.float32)
    if dtype == "bfloat16":
        bits = bf16_bits_from_float32(vals)
        return tensor_from_numpy(bits, dtype, tvm.cpu()), float32_from_bf16_bits(bits).astype(np.float64)
    stored = vals.astype(dtype)
    return tensor_from_numpy(stored, dtype, tvm.cpu()), stored.astype(np.float64)


def run_linear(func, features, x, w_tensor, n):
    lib = tvm.compile(func, target=llvm_target(features))
    dev = tvm.cpu()
    y = tvm.runtime.empty((x.shape[0], n), "float32", dev)
    lib[str(func.attrs["global_symbol"])](tensor_from_numpy(x, "float32", dev), w_tensor, y)
    return y.numpy()


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@needs_avx2
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("m,n,k", [(1, 37, 4099), (3, 37, 4099), (1, 64, 3), (2, 96, 256)])
def test_gemv_matches_float64(dtype, m, n, k):
    rng = np.random.default_rng(m * 1000 + k)
    w, w64 = random_weight(rng, n, k, dtype)
    x = rng.standard_normal((m, k), dtype=np.float32)
    got = run_linear(make_gemv(m, n, k, dtype, select_isa(AVX2)), AVX2, x, w, n)
    err = rel_err(got, x.astype(np.float64) @ w64.T)
    print(f"gemv m={m} n={n} k={k} {dtype}: rel err {err:.2e}")
    assert err <= 1e-3


@needs_avx2
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("tokens,n,k", [(5, 37, 4099), (9, 50, 3), (1, 64, 512), (17, 40, 1000)])
def test_gemm_matches_float64(dtype, tokens, n, k):
    rng = np.random.default_rng(tokens * 1000 + k)
    w, w64 = random_weight(rng, n, k, dtype)
    x = rng.standard_normal((tokens, k), dtype=np.float32)
    # A small K block so that K=1000 spans several blocks and exercises the accumulate-into-y path.
    tiling = GemmTiling(mr=4, nr=3, kc=128, rows_per_task=24)
    got = run_linear(make_gemm(n, k, dtype, select_isa(AVX2), tiling), AVX2, x, w, n)
    err = rel_err(got, x.astype(np.float64) @ w64.T)
    print(f"gemm tokens={tokens} n={n} k={k} {dtype}: rel err {err:.2e}")
    assert err <= 1e-3


def test_portable_fallback_is_correct_on_any_x86():
    """The no-AVX2 tier (x86-64 baseline) decodes fp16 bits itself; it must still be exact."""
    rng = np.random.default_rng(7)
    for dtype in ("float16", "bfloat16"):
        w, w64 = random_weight(rng, 19, 133, dtype)
        x = rng.standard_normal((1, 133), dtype=np.float32)
        isa = select_isa(("sse2",))
        assert isa.is_slow_fallback
        got = run_linear(make_gemv(1, 19, 133, dtype, isa), ("sse2",), x, w, 19)
        err = rel_err(got, x.astype(np.float64) @ w64.T)
        print(f"sse2 gemv {dtype}: rel err {err:.2e}")
        assert err <= 1e-3


def test_fp16_bit_decoding_covers_every_half_value():
    """All 65536 fp16 bit patterns (normals, subnormals, +-0, +-inf, NaN) through the fallback's decoder."""
    from tvm.script import tirx as T
    from helmc.schedules.cpu.weight_load import widen

    @T.prim_func
    def decode(h: T.Buffer((65536,), "float16"), out: T.Buffer((65536,), "float32")):
        T.func_attr({"global_symbol": "decode"})
        for i in T.serial(4096):
            for v in T.vectorized(16):  # the GEMV's sse2 chunk width
                out[i * 16 + v] = widen(h[i * 16 + v], "float16", False)

    lib = tvm.compile(decode, target=llvm_target(("sse2",)))
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    out = tvm.runtime.empty((65536,), "float32", tvm.cpu())
    lib["decode"](tensor_from_numpy(halves, "float16", tvm.cpu()), out)
    got, want = out.numpy(), halves.astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    print(f"fp16 decode: {int((~same).sum())} of 65536 patterns differ")
    assert same.all()


def test_isa_follows_target_features_not_build_machine():
    spr, avx2, bare = select_isa(SPR), select_isa(AVX2), select_isa(("sse2", "fma"))
    assert (spr.tier, spr.fp32_lanes) == ("avx512", 16)
    assert "+avx512bf16" in spr.llvm_mattr and "+avx512fp16" in spr.llvm_mattr
    assert (avx2.tier, avx2.fp32_lanes) == ("avx2", 8) and "+avx512f" not in avx2.llvm_mattr
    # A preset that lists only the essential flags still gets the AVX2 kernel, and requires only those.
    short = select_isa(("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"))
    assert short.tier == "avx2" and "movbe" not in short.required_flags and "bmi2" in short.required_flags
    assert bare.tier == "sse2" and bare.is_slow_fallback
    assert "avx512f" in required_cpu_features(SPR) and "avx512f" not in required_cpu_features(AVX2)
    assert missing_flags(required_cpu_features(SPR), AVX2) == tuple(
        f for f in required_cpu_features(SPR) if f not in AVX2)
    # Cross-compiling for the AVX-512 target must produce 512-bit code even on a machine without it.
    lib = tvm.compile(make_gemv(1, 64, 1024, "bfloat16", spr), target=llvm_target(SPR))
    asm = lib.mod.inspect_source("asm")
    assert re.search(r"vfmadd\w*ps\s+[^\n]*zmm", asm), "AVX-512 target did not use zmm FMAs"
    # One software prefetch per weight row and K step (gemv.PREFETCH_STEPS ahead), none when it is 0.
    from helmc.schedules.cpu import gemv as gemv_module
    assert gemv_module.PREFETCH_STEPS > 0 and asm.count("prefetcht0") == 4   # 4 rows per step
    saved, gemv_module.PREFETCH_STEPS = gemv_module.PREFETCH_STEPS, 0
    try:
        plain = tvm.compile(make_gemv(1, 64, 1024, "bfloat16", spr), target=llvm_target(SPR)).mod.inspect_source("asm")
    finally:
        gemv_module.PREFETCH_STEPS = saved
    assert "prefetcht0" not in plain


def test_bf16_tensor_round_trip():
    bits = bf16_bits_from_float32(np.array([[1.0, -2.5, 3.1415927], [1e-3, 65504.0, -0.0]], np.float32))
    t = tensor_from_numpy(bits, "bfloat16", tvm.cpu())
    assert str(t.dtype) == "bfloat16"
    assert np.array_equal(numpy_from_tensor(t), bits)
    assert float32_from_bf16_bits(bits)[0, 2] == np.float32(3.140625)  # round-to-nearest-even
    with pytest.raises(TypeError):
        tensor_from_numpy(bits.astype(np.float32), "bfloat16", tvm.cpu())
