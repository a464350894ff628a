"""Quantized decode GEMVs (schedules/cpu/gemv_quant.py) against gguf's NumPy dequantizer in float64.

Weights: Q8_0 / Q4_0 quantized from Gaussian rows with gguf.quants.quantize; Q4_K / Q6_K (gguf cannot
quantize those) are random bytes, every byte pattern a valid quant or packed scale, with the fp16 scale
fields overwritten by small finite values so no block decodes to inf/NaN. Reference: dequantize(raw) in
float64 @ x in float64. Shapes: one block row (k = 256), a 4096-long row with few rows, and row counts that
are not multiples of the kernel's 4-row step. Tolerance: max |y - ref| / max |ref| < 1e-3, the CPU kernels'
bound; they dequantize exactly and accumulate in fp32, so they land near 1e-7. The AVX-512 tiers run Q4_K / Q6_K
with int8 activations (quant/gemv_int8.py): their reference multiplies by x quantized the way the kernel does
(int8_activations) and must agree to 1e-5; the difference against fp32 x (the int8 rounding, ~5e-3) is printed.
Every ISA tier is compiled and run where this CPU can execute it (AVX-512 cross-compiled otherwise).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
gguf_quants = pytest.importorskip("gguf.quants")

from gguf import GGMLQuantizationType as GGMLType  # noqa: E402

from helmc.errors import HelmcError  # noqa: E402
from helmc.runtime.bundle.manifest import host_cpu_flags  # noqa: E402
from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant  # noqa: E402
from helmc.schedules.cpu.gemv_quant import (QUANT_BLOCKS, QuantGemvTuning,  # noqa: E402
                                            quant_row_bytes)
from helmc.schedules.cpu.quant.gemv_int8 import INT8_TUNING, int8_gemv_applies  # noqa: E402
from helmc.schedules.cpu.isa import VectorIsa, missing_flags, select_isa  # noqa: E402

AVX2 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
AVX512 = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")
TIERS = {"avx512_vnni": AVX512 + ("avx512_vnni",), "avx512": AVX512, "avx2": AVX2, "sse2": ("sse2",)}
GGML = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0, "q5_0": GGMLType.Q5_0, "q3_k": GGMLType.Q3_K, "q4_k": GGMLType.Q4_K, "q5_k": GGMLType.Q5_K, "q6_k": GGMLType.Q6_K,
        "iq4_xs": GGMLType.IQ4_XS, "mxfp4": GGMLType.MXFP4}
# Byte offsets of the fp16 scale fields inside a K-quant block (ggml-common.h block_q4_K / block_q6_K / block_iq4_xs).
FP16_FIELDS = {"q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}


def runnable(tier: str) -> bool:
    return missing_flags(select_isa(TIERS[tier]).required_flags, host_cpu_flags()) == ()


def target(isa: VectorIsa) -> tvm.target.Target:
    # What the CPU stage compiles with (compiler passes' llvm_target): generic x86-64 plus the tier's features.
    spec: dict = {"kind": "llvm", "mcpu": isa.llvm_mcpu}
    if isa.llvm_mattr:
        spec["mattr"] = list(isa.llvm_mattr)
    return tvm.target.Target(spec)


def random_quant_weight(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """Raw GGUF rows, uint8 [n, row_bytes]."""
    if qtype in ("q8_0", "q4_0", "q5_0"):
        return gguf_quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGML[qtype])
    fmt = QUANT_BLOCKS[qtype]
    raw = rng.integers(0, 256, (n, k // fmt.weights, fmt.bytes), dtype=np.uint8)   # [n, blocks, block bytes]
    if qtype == "mxfp4":        # e8m0 byte: scales 2^-16 .. 2^-4 per block (|w| <= 0.75), none dominating the row
        raw[:, :, 0] = rng.integers(112, 125, raw.shape[:2])
    for at in FP16_FIELDS.get(qtype, ()):
        scale = rng.uniform(1e-3, 1e-2, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])
        raw[:, :, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, -1, 2)  # [n, blocks, 2]
    return raw.reshape(n, -1)                                                             # [n, row_bytes]


def run_gemv(qtype: str, tier: str, raw: np.ndarray, x: np.ndarray,
             tuning: QuantGemvTuning = QuantGemvTuning()) -> np.ndarray:
    n, k = raw.shape[0], x.shape[0]
    isa = select_isa(TIERS[tier])
    func = make_gemv_quant(qtype, n, k, isa, tuning)
    lib = tvm.compile(func, target=target(isa))
    y = tvm.runtime.empty((1, n), "float32", tvm.cpu())
    lib[str(func.attrs["global_symbol"])](tvm.runtime.tensor(x.reshape(1, k)), tvm.runtime.tensor(raw), y)  # [k] -> [1, k]
    return y.numpy().reshape(n)                                                                              # [1, n] -> [n]


def int8_activations(x: np.ndarray, qtype: str = "q4_k") -> np.ndarray:
    """x [m, k] as quant/gemv_int8.py sees it, in float64: per 256 values (Q4_0, MXFP4: per 32, their weight block)
    dx = max|x| / 127 and xq = rint(x * (127 / max|x|)) in fp32 arithmetic, then xq * dx."""
    block = 32 if qtype in ("q4_0", "mxfp4") else 256
    blocks = x.reshape(x.shape[0], -1, block)                                           # [m, k] -> [m, k / b, b]
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(blocks * inv)
    return (xq.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)  # -> [m, k]


def check_against_float64(qtype, tier, n, k, tuning=QuantGemvTuning()):
    rng = np.random.default_rng(n * 7919 + k)
    raw = random_quant_weight(rng, qtype, n, k)
    assert raw.shape == (n, quant_row_bytes(qtype, k))
    x = rng.standard_normal(k).astype(np.float32)
    dequant = gguf_quants.dequantize(raw, GGML[qtype]).astype(np.float64)
    ref = dequant @ x.astype(np.float64)
    got = run_gemv(qtype, tier, raw, x, tuning)
    err = float(np.abs(got - ref).max()) / float(np.abs(ref).max())
    if int8_gemv_applies(qtype, select_isa(TIERS[tier]), k):
        ref8 = dequant @ int8_activations(x.reshape(1, k), qtype)[0]
        err8 = float(np.abs(got - ref8).max()) / float(np.abs(ref8).max())
        print(f"{qtype} {tier} n={n} k={k} {tuning}: rel err {err8:.2e} against int8 x, {err:.2e} against fp32 x")
        assert err8 < 1e-5 and err < 3e-2
        return
    print(f"{qtype} {tier} n={n} k={k} {tuning}: max |diff| {float(np.abs(got - ref).max()):.3e}, rel err {err:.2e}")
    assert err < 1e-3


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("qtype", list(QUANT_BLOCKS))
@pytest.mark.parametrize("n,k", [(37, 256), (6, 4096), (64, 1024)])
def test_quant_gemv_matches_float64(qtype, tier, n, k):
    if not runnable(tier):
        pytest.skip(f"this CPU cannot run the {tier} tier")
    check_against_float64(qtype, tier, n, k)


@pytest.mark.parametrize("qtype", list(QUANT_BLOCKS))
@pytest.mark.parametrize("tuning", [QuantGemvTuning(rows=3, prefetch_bytes=0),
                                    QuantGemvTuning(rows=1, prefetch_bytes=1 << 20, prefetch_locality=1)])
def test_quant_gemv_tunings(qtype, tuning):
    """Other row counts (19 rows: a partial last group) and prefetch settings (none; further than a row)."""
    tier = next(t for t in TIERS if runnable(t))
    check_against_float64(qtype, tier, 19, 512, tuning)


@pytest.mark.parametrize("tier", ["avx512_vnni", "avx512", "avx2"])
def test_mxfp4_at_gpt_oss_row_length(tier):
    """gpt-oss's K = 2880: 90 MXFP4 blocks, whole two-block units of the int8 path (not Q4_0's four-block ones)."""
    if not runnable(tier):
        pytest.skip(f"this CPU cannot run {tier}")
    assert int8_gemv_applies("mxfp4", select_isa(TIERS[tier]), 2880) == tier.startswith("avx512")
    check_against_float64("mxfp4", tier, 21, 2880)


def test_avx512_tier_cross_compiles_to_zmm():
    """The AVX-512 kernels must use 512-bit registers even when built on a machine without AVX-512, the fp32-lane
    kernels their vpermps nibble table (LLVM may print the integer twin vpermd), Q4_K / Q6_K / Q4_0 / MXFP4 their
    integer dot products (vpdpwssd / vpdpbusd only where the target has VNNI; MXFP4's values one vpshufb), and all
    of them prefetch."""
    for flags in (AVX512, TIERS["avx512_vnni"]):
        isa = select_isa(flags)
        for qtype in QUANT_BLOCKS:
            asm = tvm.compile(make_gemv_quant(qtype, 8, 512, isa), target=target(isa)).mod.inspect_source("asm")
            # llvm.prefetch locality 3 / 2 / 1 prints as prefetcht0 / t1 / t2 (the int8 path's INT8_TUNING)
            locality = INT8_TUNING[qtype].prefetch_locality if int8_gemv_applies(qtype, isa, 512) else 3
            assert "zmm" in asm and f"prefetcht{3 - locality}" in asm, (qtype, locality)
            if int8_gemv_applies(qtype, isa, 512):   # integer dot products: vpdpwssd / vpdpbusd with VNNI
                bytewise = qtype in ("q4_0", "mxfp4")                 # vpdpbusd over bytes, no int16 scales
                vnni = "vpdpbusd" if bytewise else "vpdpwssd"
                assert bool(re.search(r"vpmaddubsw\s[^\n]*zmm", asm)) != (bytewise and "avx512_vnni" in flags), qtype
                if qtype == "mxfp4":                                   # kvalues_mxfp4 + 12: one byte table lookup
                    assert re.search(r"vpshufb\s[^\n]*zmm", asm), qtype
                assert bool(re.search(vnni + r"\s[^\n]*zmm", asm)) == ("avx512_vnni" in flags), qtype
            elif qtype != "q8_0":
                assert re.search(r"vperm(ps|d)\s[^\n]*zmm", asm), qtype


@pytest.mark.parametrize("qtype", list(QUANT_BLOCKS))
def test_bad_shape_is_refused(qtype):
    block = QUANT_BLOCKS[qtype].weights
    expected = rf"expected a positive multiple of its {block}-weight block, found k={block + 16}"
    with pytest.raises(HelmcError, match=expected):
        make_gemv_quant(qtype, 8, block + 16, select_isa(AVX2))
    with pytest.raises(HelmcError, match=r"expected one of .*found 'q2_k'"):
        make_gemv_quant("q2_k", 8, 256, select_isa(AVX2))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q5_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4"])
@pytest.mark.parametrize("n,k,rows,wrap,ahead", [(4096, 4096, 8, None, None), (64, 4096, 8, 16, 3 * 144),
                                                 (13, 256, 4, None, None), (2, 256, 8, None, None)])
def test_prefetch_addresses_stay_inside_the_weight(qtype, n, k, rows, wrap, ahead):
    """Every byte the kernel's prefetches name lies in W, both where the group's first row is clamped once (the
    cheap path, large W) and where each address is clamped (small W): brute force over every group, row, block and
    line, with the macro's own index arithmetic (a prefetch past W would not fault on x86, so no run can show it)."""
    from helmc.schedules.cpu.quant.prefetch import prefetch_plan
    block = QUANT_BLOCKS[qtype]
    row_bytes = quant_row_bytes(qtype, k)
    tuning = QuantGemvTuning(rows=rows, prefetch_bytes=1024)
    got, every, lines, index = prefetch_plan(rows, block.bytes, row_bytes, tuning, n, ahead, wrap)
    step = wrap or rows
    addresses = [index(first, r, b, line, min, lambda c, a, z: a if c else z)
                 for first in range(0, n, step) for r in range(rows) for b in range(0, k // block.weights, every)
                 for line in range(lines)]
    assert got > 0 and min(addresses) >= 0 and max(addresses) < n * row_bytes, (min(addresses), max(addresses))
