"""Fused decode GEMVs (q/k/v in one launch, gate/up with the SwiGLU product) and the AMX prefill GEMM,
against NumPy float64 on random inputs.

Odd shapes on purpose: K=4099 and K=77 are not multiples of any vector width, row counts 37/5/9 not of the
GEMV's row step. Tolerance as the issue asks: relative error (max |diff| over max |ref|) <= 1e-3; the
kernels accumulate in fp32, so they land near 1e-6. The AMX GEMM cannot run on a CPU without AMX: its
loops are checked here with each tile instruction emulated in plain TIR (make_gemm_amx(emulate=True)), and
the real build is checked to contain the tile instructions; `benchmarks/bench_cpu_gemv.py --run-only` checks
it on an AMX machine. No stored references: NumPy recomputes them on every run.
"""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from helmc.runtime.tvm_tensors import bf16_bits_from_float32, float32_from_bf16_bits, tensor_from_numpy  # noqa: E402
from helmc.compiler.passes.schedule_cpu_stage import llvm_target, required_cpu_features  # noqa: E402
from helmc.schedules.cpu.gemm_amx import (BLOCKING_VARIANTS, MEASURED_BLOCKING, AmxBlocking,  # noqa: E402
                                          amx_gemm_applies, blocking_for, blocking_named, k_block_dividing,
                                          make_gemm_amx, make_gemm_amx_multi)
from helmc.schedules.cpu.gemv_fused import make_gemv_multi, make_gemv_swiglu  # noqa: E402
from helmc.schedules.cpu.isa import missing_flags, select_isa  # noqa: E402
from helmc.runtime.bundle.manifest import host_cpu_flags  # noqa: E402

AVX2 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
SPR_AMX = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")



needs_avx2 = pytest.mark.skipif(missing_flags(AVX2, host_cpu_flags()) != (), reason="this CPU lacks AVX2/FMA/F16C")


def random_weight(rng, n, k, dtype):
    """(tensor, float64 copy of exactly what the kernel reads)."""
    vals = rng.standard_normal((n, k), dtype=np.float32)
    if dtype == "bfloat16":
        bits = bf16_bits_from_float32(vals)
        return tensor_from_numpy(bits, dtype, tvm.cpu()), float32_from_bf16_bits(bits).astype(np.float64)
    stored = vals.astype(dtype)
    return tensor_from_numpy(stored, dtype, tvm.cpu()), stored.astype(np.float64)


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def amx_activations64(x: np.ndarray, dtype: str, split: bool | None) -> np.ndarray:
    """float64 of the activations the AMX GEMM multiplies: the model's precision (bf16 weights: x rounded to
    bf16, as HF's bf16 linear) unless split (hi + lo, ~16 bits: x itself to the tolerance)."""
    if dtype == "bfloat16" and not split:
        return float32_from_bf16_bits(bf16_bits_from_float32(x)).astype(np.float64)
    return x.astype(np.float64)


def check_amx_output(y: np.ndarray, x: np.ndarray, w64: np.ndarray, dtype: str, split: bool | None, what: str):
    """fp32 sums of the kernel's activations: <= 1e-4 against float64 of them. Against the unrounded x, a
    bf16-activation kernel is off by bf16's rounding (~2e-3, torch's bf16 linear alike), so < 1e-2."""
    err = rel_err(y, amx_activations64(x, dtype, split) @ w64.T)
    err_x = rel_err(y, x.astype(np.float64) @ w64.T)
    print(f"{what}: rel err {err:.2e} (against the unrounded fp32 x: {err_x:.2e})")
    assert err <= 1e-4
    assert err_x <= (1e-4 if dtype == "float16" or split else 1e-2)


def call(func, features, *args):
    lib = tvm.compile(func, target=llvm_target(features))
    lib[str(func.attrs["global_symbol"])](*args)


@needs_avx2
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,ns,k", [(1, (37, 5, 9), 4099), (2, (40, 24), 100)])
def test_multi_gemv_matches_float64(dtype, m, ns, k):
    rng = np.random.default_rng(m * 100 + len(ns))
    dev = tvm.cpu()
    weights = [random_weight(rng, n, k, dtype) for n in ns]
    x = rng.standard_normal((m, k), dtype=np.float32)
    ys = [tvm.runtime.empty((m, n), "float32", dev) for n in ns]
    call(make_gemv_multi(m, ns, k, dtype, select_isa(AVX2)), AVX2, tensor_from_numpy(x, "float32", dev),
         *[w for w, _ in weights], *ys)
    for i, (y, (_, w64)) in enumerate(zip(ys, weights)):
        err = rel_err(y.numpy(), x.astype(np.float64) @ w64.T)
        print(f"gemv{len(ns)} output {i} m={m} n={ns[i]} k={k} {dtype}: rel err {err:.2e}")
        assert err <= 1e-3


@needs_avx2
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(1, 37, 4099), (3, 21, 77)])
def test_swiglu_gemv_matches_float64(dtype, m, n, k):
    rng = np.random.default_rng(n * k)
    dev = tvm.cpu()
    (wg, g64), (wu, u64) = random_weight(rng, n, k, dtype), random_weight(rng, n, k, dtype)
    x = rng.standard_normal((m, k), dtype=np.float32) / np.float32(np.sqrt(k))
    y = tvm.runtime.empty((m, n), "float32", dev)
    call(make_gemv_swiglu(m, n, k, dtype, select_isa(AVX2)), AVX2, tensor_from_numpy(x, "float32", dev), wg, wu, y)
    g, u = x.astype(np.float64) @ g64.T, x.astype(np.float64) @ u64.T
    err = rel_err(y.numpy(), g / (1 + np.exp(-g)) * u)
    print(f"swiglu gemv m={m} n={n} k={k} {dtype}: rel err {err:.2e}")
    assert err <= 1e-3


@needs_avx2
@pytest.mark.parametrize("dtype,split", [("bfloat16", None), ("bfloat16", True), ("float16", None)])
@pytest.mark.parametrize("tokens,n,k", [(1, 32, 32), (5, 64, 96), (33, 96, 128)])
def test_amx_gemm_loops_match_float64_with_emulated_tiles(dtype, split, tokens, n, k):
    """Packing (hi/lo bf16 split, pair-interleaved layout, token padding), fp16 panel split, tile indexing
    and stores; the tile instructions themselves are replaced by their definitions."""
    rng = np.random.default_rng(tokens * 7 + n)
    dev = tvm.cpu()
    w, w64 = random_weight(rng, n, k, dtype)
    if dtype == "float16":  # the extremes of fp16 (max, subnormals, -0) must split into bf16 hi + lo exactly
        stored = np.array([65504, 6e-5, -3e-6, 1e-7, -0.0], np.float16)
        w64[0, :5] = stored.astype(np.float64)
        host = w.numpy()
        host[0, :5] = stored
        w = tensor_from_numpy(host, dtype, dev)
    x = rng.standard_normal((tokens, k), dtype=np.float32)
    y = tvm.runtime.empty((tokens, n), "float32", dev)
    call(make_gemm_amx(n, k, dtype, emulate=True, split_activations=split), AVX2,
         tensor_from_numpy(x, "float32", dev), w, y)
    check_amx_output(y.numpy(), x, w64, dtype, split,
                     f"amx gemm {dtype} split={split} (emulated tiles) tokens={tokens} n={n} k={k}")


# A blocking small enough that the test shapes span several K blocks, token chunks and panel groups.
SMALL_BLOCKS = dict(k_block=64, tasks=3, token_chunk=64)


@needs_avx2
@pytest.mark.parametrize("dtype,pack,prefetch,split", [("bfloat16", True, True, None), ("float16", True, True, None),
                                                       ("bfloat16", False, False, None), ("bfloat16", True, False, True)])
@pytest.mark.parametrize("tokens", [70, 31])
def test_amx_gemm_blocking_tails_match_float64_with_emulated_tiles(dtype, pack, prefetch, split, tokens):
    """K = 192 in three K blocks (partial sums through the C buffer), 160 rows = 5 panels over 3 tasks
    (groups of 2, 2, 1), 70 tokens = a full 64-token chunk and a 6-token one (padded to 32), 31 tokens =
    one partial chunk; with packed (bf16 copy / fp16 hi-lo) and direct weight tiles, with and without the
    next-panel prefetch."""
    n, k = 160, 192
    rng = np.random.default_rng(tokens * 11 + (dtype == "float16"))
    dev = tvm.cpu()
    w, w64 = random_weight(rng, n, k, dtype)
    x = rng.standard_normal((tokens, k), dtype=np.float32)
    y = tvm.runtime.empty((tokens, n), "float32", dev)
    blocking = AmxBlocking(pack_bf16=pack, prefetch=prefetch, **SMALL_BLOCKS)
    assert k_block_dividing(k, blocking.k_block) == 64
    call(make_gemm_amx(n, k, dtype, emulate=True, blocking=blocking, split_activations=split), AVX2,
         tensor_from_numpy(x, "float32", dev), w, y)
    check_amx_output(y.numpy(), x, w64, dtype, split,
                     f"amx gemm {dtype} split={split} (emulated, K blocks of 64, chunks of 64) tokens={tokens} n={n} k={k}")


@needs_avx2
@pytest.mark.parametrize("dtype,ns,pack,tokens,split", [("bfloat16", (96, 32, 32), True, 70, None),
                                                        ("float16", (64, 96), True, 33, None),
                                                        ("bfloat16", (32, 64, 64), False, 31, None),
                                                        ("bfloat16", (64, 32), True, 33, True)])
def test_amx_gemm_multi_matches_float64_with_emulated_tiles(dtype, ns, pack, tokens, split):
    """One launch over 2-3 weights sharing x (prefill q/k/v, gate/up): panels of the concatenation split over
    3 tasks in groups that straddle weights (e.g. 5 panels: {w0, w0}, {w0, w1}, {w2}), K in 3 blocks,
    tokens in 64-token chunks; each y_i against float64."""
    k = 192
    rng = np.random.default_rng(tokens * 13 + len(ns))
    dev = tvm.cpu()
    weights = [random_weight(rng, n, k, dtype) for n in ns]
    x = rng.standard_normal((tokens, k), dtype=np.float32)
    ys = [tvm.runtime.empty((tokens, n), "float32", dev) for n in ns]
    blocking = AmxBlocking(pack_bf16=pack, **SMALL_BLOCKS)
    call(make_gemm_amx_multi(ns, k, dtype, emulate=True, blocking=blocking, split_activations=split), AVX2,
         tensor_from_numpy(x, "float32", dev), *[w for w, _ in weights], *ys)
    for i, (y, (_, w64)) in enumerate(zip(ys, weights)):
        check_amx_output(y.numpy(), x, w64, dtype, split,
                         f"amx gemm{len(ns)} output {i} {dtype} split={split} (emulated) tokens={tokens} n={ns[i]} k={k}")


def test_amx_gemm_multi_compiles_for_an_amx_target():
    """The fused launch keeps the products of one weight's kernel per 32-k step (bf16: 4 at the model's
    precision, 8 split; fp16: 12) per weight's copy of the panel body, and a distinct symbol naming every
    weight's N and the split."""
    import re
    for dtype, split, products, suffix in (("bfloat16", None, 4, ""), ("bfloat16", True, 8, "_xsplit"),
                                           ("float16", None, 12, "")):
        func = make_gemm_amx_multi((1024, 256, 256), 512, dtype, blocking=blocking_named("kc512"),
                                   split_activations=split)
        assert str(func.attrs["global_symbol"]) == \
            f"helmc_gemm3_amx_{'bf16' if dtype == 'bfloat16' else 'f16'}_n1024_256_256_k512_kc512{suffix}"
        asm = tvm.compile(func, target=llvm_target(SPR_AMX)).mod.inspect_source("asm")
        dots = len(re.findall(r"\btdpbf16ps\b", asm))
        assert dots >= 3 * products and dots % products == 0, (dtype, dots)


def test_blocking_for_follows_the_measured_table_and_its_rule():
    for (n, k, dtype), name in MEASURED_BLOCKING.items():
        assert (blocking_for(n, k, dtype).name or "default") == name
    assert blocking_for(4096, 4096, "bfloat16").pack_bf16 is False            # measured: direct
    assert blocking_for(12288, 4096, "bfloat16").k_block == 512               # measured: kc512
    assert blocking_for(1024 + 4096 + 1024, 4096, "bfloat16").name == "direct"  # fused q/k/v (rule)
    assert blocking_for(2 * 12288, 4096, "bfloat16").name == "kc512"          # fused gate/up (rule)
    assert blocking_for(6144, 4096, "float16").name == "kc512"
    assert blocking_for(512, 2560, "bfloat16").name == ""
    assert blocking_for(5120, 17408, "bfloat16").name == "direct"


def test_k_block_divides_k():
    assert k_block_dividing(4096, 256) == 256 and k_block_dividing(9728, 512) == 512
    assert k_block_dividing(96, 64) == 32 and k_block_dividing(32, 256) == 32 and k_block_dividing(4800, 256) == 192
    for k in (32, 96, 2560, 9728, 17408, 4800):
        kc = k_block_dividing(k, 256)
        assert kc % 32 == 0 and k % kc == 0 and kc <= 256, (k, kc)


def test_amx_gemm_is_selected_and_compiles_for_an_amx_target_only():
    spr, avx512 = select_isa(SPR_AMX), select_isa(tuple(f for f in SPR_AMX if not f.startswith("amx")))
    assert spr.has_amx_bf16 and not avx512.has_amx_bf16 and not select_isa(AVX2).has_amx_bf16
    assert {"amx_tile", "amx_bf16"} <= set(required_cpu_features(SPR_AMX))
    assert amx_gemm_applies(4096, 4096, "bfloat16", spr)
    assert amx_gemm_applies(4096, 4096, "float16", spr)          # split into bf16 hi + lo per panel
    assert not amx_gemm_applies(4096, 4096, "float32", spr)
    assert not amx_gemm_applies(4096, 4096, "bfloat16", avx512)
    assert not amx_gemm_applies(4100, 4096, "bfloat16", spr)     # partial tiles go to gemm.py
    for dtype in ("bfloat16", "float16"):
        lib = tvm.compile(make_gemm_amx(64, 128, dtype), target=llvm_target(SPR_AMX))
        asm = lib.mod.inspect_source("asm")
        for instr in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease", "prefetcht1"):
            assert instr in asm, f"AMX {dtype} build lacks {instr}"


def test_amx_gemm_variants_compile_with_distinct_symbols():
    """Every blocking the benchmark compares builds for the AMX target under its own name; the products per
    32-k step are 4 (bf16 at the model's precision: W.x on 2 x 2 C tiles) and 12 (fp16: Whi.xhi + Whi.xlo +
    Wlo.xhi)."""
    import re
    names = set()
    for blocking in BLOCKING_VARIANTS:
        for dtype, products in (("bfloat16", 4), ("float16", 12)):
            func = make_gemm_amx(1024, 512, dtype, blocking=blocking)
            names.add(str(func.attrs["global_symbol"]))
            asm = tvm.compile(func, target=llvm_target(SPR_AMX)).mod.inspect_source("asm")
            dots = len(re.findall(r"\btdpbf16ps\b", asm))
            assert dots >= products and dots % products == 0, (blocking.name, dtype, dots)
            assert ("prefetcht1" in asm) == blocking.prefetch, (blocking.name, dtype)
    assert len(names) == 2 * len(BLOCKING_VARIANTS)


@pytest.mark.parametrize("tier", ["avx512_vnni", "avx512"])
@pytest.mark.parametrize("qtype", ["q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "mxfp4"])
@pytest.mark.parametrize("ns", [(37, 16, 16), (21, 37)])
def test_quant_multi_gemv_is_bitwise_its_single_kernels(tier, qtype, ns):
    """q/k/v (or gate/up) of one int8-path type in one launch: every weight's output the bits of its own kernel."""
    pytest.importorskip("gguf")
    from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant
    from helmc.schedules.cpu.quant.gemv_int8_multi import make_gemv_quant_int8_multi
    from test_cpu_quant_gemv import TIERS, random_quant_weight, target
    isa = select_isa(TIERS[tier])
    if missing_flags(isa.required_flags, host_cpu_flags()):
        pytest.skip(f"this CPU cannot run the {tier} tier")
    rng = np.random.default_rng(17)
    k = 768
    ws = [tvm.runtime.tensor(random_quant_weight(rng, qtype, n, k)) for n in ns]
    x = tvm.runtime.tensor(rng.standard_normal((1, k)).astype(np.float32))

    def run(f, weights, outs_n):
        lib = tvm.compile(f, target=target(isa))
        outs = [tvm.runtime.empty((1, n), "float32", tvm.cpu()) for n in outs_n]
        lib[str(f.attrs["global_symbol"])](x, *weights, *outs)
        return [o.numpy() for o in outs]
    fused = run(make_gemv_quant_int8_multi(qtype, ns, k, isa), ws, ns)
    for i, n in enumerate(ns):
        (single,) = run(make_gemv_quant(qtype, n, k, isa), [ws[i]], (n,))
        assert np.array_equal(fused[i].view(np.uint32), single.view(np.uint32)), (qtype, ns, i)
