"""Batch invariance of the CPU stage's decode GEMVs: row t of an m-row call must be bit-identical to
the 1-row kernel on x[t] alone, for every m up to GEMV_MAX_ROWS, every kernel kind (plain, q/k/v multi-output,
SwiGLU, the four quantized types) and every ISA tier this CPU runs (AVX-512 token passes differ from AVX2's).
Odd shapes: n = 37 leaves a partial last row step, k = 4099 a scalar K tail (float kernels)."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from helmc.runtime.bundle.manifest import host_cpu_flags  # noqa: E402
from helmc.runtime.tvm_tensors import bf16_bits_from_float32, tensor_from_numpy  # noqa: E402
from helmc.schedules.cpu.gemv import GEMV_MAX_ROWS, make_gemv, tiled_blocking  # noqa: E402
from helmc.schedules.cpu.gemv_fused import make_gemv_multi, make_gemv_swiglu  # noqa: E402
from helmc.schedules.cpu.gemv_quant import QUANT_BLOCKS  # noqa: E402
from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant  # noqa: E402
from helmc.schedules.cpu.isa import missing_flags, select_isa  # noqa: E402
from test_cpu_quant_gemv import TIERS, random_quant_weight, target  # noqa: E402

ROWS = (2, 3, 5, GEMV_MAX_ROWS)


def _tier(name):
    isa = select_isa(TIERS[name])
    if missing_flags(isa.required_flags, host_cpu_flags()):
        pytest.skip(f"this CPU cannot run the {name} tier")
    return isa


def _rows_equal_single(kernels, x, isa):
    """kernels: (make, inputs, n_outs) each, make(m) -> PrimFunc(x[m, k], *inputs, *outs[m, n_i]); every row of
    every m equals the 1-row call's bits. Every kernel at every m is one function of a single module, compiled once:
    the m-row functions are what the stage compiles, their module is not, and one LLVM run is far cheaper than one
    per function."""
    funcs = {}
    for j, (make, _, _) in enumerate(kernels):
        for m in (1,) + ROWS:
            funcs[j, m] = make(m)
    symbols = [str(f.attrs["global_symbol"]) for f in funcs.values()]
    assert len(set(symbols)) == len(symbols), symbols
    lib = tvm.compile(tvm.IRModule({s: f for s, f in zip(symbols, funcs.values())}), target=target(isa))

    def call(j, m, xm):
        _, inputs, n_outs = kernels[j]
        outs = [tvm.runtime.empty((m, n), "float32", tvm.cpu()) for n in n_outs]
        lib[str(funcs[j, m].attrs["global_symbol"])](tvm.runtime.tensor(np.ascontiguousarray(xm)), *inputs, *outs)
        return [o.numpy() for o in outs]
    for j, (_, _, n_outs) in enumerate(kernels):
        singles = [call(j, 1, x[t:t + 1]) for t in range(GEMV_MAX_ROWS)]
        for m in ROWS:
            got = call(j, m, x[:m])
            for t in range(m):
                for i in range(len(n_outs)):
                    assert np.array_equal(got[i][t].view(np.uint32), singles[t][i][0].view(np.uint32)), (j, m, t, i)


def _float_kernels(m, dtype, isa):
    return (make_gemv(m, 37, 4099, dtype, isa), make_gemv_multi(m, (37, 16, 16), 4099, dtype, isa),
            make_gemv_swiglu(m, 37, 4099, dtype, isa))


def test_float_kernels_do_not_depend_on_vnni():
    """Why the float checks below skip the AVX-512 VNNI tier: VNNI is an int8 dot product; the two tiers' ISAs
    differ only in the LLVM target's flags, and the float kernels of that tier are plain AVX-512's (checked on the
    one-row and the tiled m-row kernels: building every m of every dtype costs more than running the checks)."""
    import dataclasses
    vnni, plain = select_isa(TIERS["avx512_vnni"]), select_isa(TIERS["avx512"])
    assert "avx512_vnni" in vnni.required_flags and "avx512_vnni" not in plain.required_flags
    assert dataclasses.replace(vnni, llvm_mattr=plain.llvm_mattr, required_flags=plain.required_flags) == plain
    for m in (1, GEMV_MAX_ROWS):
        for a, b in zip(_float_kernels(m, "float16", vnni), _float_kernels(m, "float16", plain)):
            tvm.ir.assert_structural_equal(a, b)


# Every weight dtype at AVX2 (which every x86-64-v3 host runs), fp16 alone at AVX-512 and SSE2: a float kernel's
# accumulation order (what makes a row the bits of its 1-row call) comes from the tier's blocking, which no dtype
# enters (gemv.tiled_blocking, gemv_blocking); the dtype only widens each weight to fp32 exactly
# (weight_load.widen), in the same place at every tier. fp16 is the tier-dependent widening (F16C on AVX2 and
# AVX-512, bit decoding on SSE2); test_cpu_kernels.py checks the SSE2 tier's fp16 and bf16 against float64.
FLOAT_CASES = [("float16", "avx512"), ("float16", "avx2"), ("bfloat16", "avx2"), ("float32", "avx2"),
               ("float16", "sse2")]


@pytest.mark.parametrize("dtype,tier", FLOAT_CASES)
def test_float_gemvs_rows_are_single_rows(tier, dtype):
    isa = _tier(tier)
    rng = np.random.default_rng(11)
    k, ns = 4099, (37, 16, 16)
    ws = [rng.standard_normal((n, k)).astype(np.float32) for n in ns]
    if dtype == "bfloat16":
        tensors = [tensor_from_numpy(bf16_bits_from_float32(w), "bfloat16", tvm.cpu()) for w in ws]
    else:
        tensors = [tvm.runtime.tensor(w.astype(dtype)) for w in ws]
    x = rng.standard_normal((GEMV_MAX_ROWS, k)).astype(np.float32)
    _rows_equal_single([(lambda m: make_gemv(m, ns[0], k, dtype, isa), tensors[:1], ns[:1]),
                        (lambda m: make_gemv_multi(m, ns, k, dtype, isa), tensors, ns),
                        (lambda m: make_gemv_swiglu(m, 37, k, dtype, isa), tensors[:1] * 2, (37,))], x, isa)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("qtype", list(QUANT_BLOCKS))
def test_quant_gemv_rows_are_single_rows(tier, qtype):
    pytest.importorskip("gguf")
    isa = _tier(tier)
    rng = np.random.default_rng(13)
    n, k = 37, 512
    w = tvm.runtime.tensor(random_quant_weight(rng, qtype, n, k))
    x = rng.standard_normal((GEMV_MAX_ROWS, k)).astype(np.float32)
    _rows_equal_single([(lambda m: make_gemv_quant(qtype, n, k, isa, m=m), [w], (n,))], x, isa)


@pytest.mark.parametrize("qtype", list(QUANT_BLOCKS))
def test_quant_gemv_rows_over_several_k_tiles(qtype):
    """k = 4096 and n = 21: the m-row kernels walk K in several tiles (the last shorter for some m) and the last
    block of rows is partial, on this CPU's best tier (the int8 kernel on AVX-512)."""
    pytest.importorskip("gguf")
    from helmc.schedules.cpu.quant.decode_gemv import quant_tiles
    from helmc.schedules.cpu.quant.gemv_int8 import INT8_UNITS, int8_gemv_applies
    isa = select_isa(host_cpu_flags())
    rng = np.random.default_rng(17)
    n, k = 21, 4096
    # What the kernel steps over along K: the type's block, or the int8 path's unit (Q4_0: four blocks)
    blocks = k // (INT8_UNITS[qtype] if int8_gemv_applies(qtype, isa, k) else QUANT_BLOCKS[qtype]).weights
    for m in ROWS:
        tiles = quant_tiles(qtype, m, k, isa)
        assert n % tiles.block_rows and tiles.rows * tiles.group * 2 <= isa.vector_registers, (m, tiles)
        if m > 3:
            assert tiles.tile_blocks < blocks, (m, tiles)                   # several K tiles
    assert any(blocks % quant_tiles(qtype, m, k, isa).tile_blocks for m in ROWS), qtype   # a shorter last tile
    w = tvm.runtime.tensor(random_quant_weight(rng, qtype, n, k))
    x = rng.standard_normal((GEMV_MAX_ROWS, k)).astype(np.float32)
    _rows_equal_single([(lambda m: make_gemv_quant(qtype, n, k, isa, m=m), [w], (n,))], x, isa)


def test_float_tiles_cover_k_in_several_tiles():
    """What test_float_gemvs_rows_are_single_rows relies on: at k = 4099 the AVX-512 and AVX2 m-row kernels take
    several K tiles (a shorter last one for m = 5), a scalar K tail, and n = 37 leaves a partial block of rows."""
    for tier in ("avx512", "avx2"):
        isa = select_isa(TIERS[tier])
        for m in ROWS:
            tb = tiled_blocking(isa, m, 4099)
            k_main = 4099 // tb.chunk
            assert 1 < -(-k_main // tb.tile_steps) and 4099 % tb.chunk and 37 % tb.block_rows, (tier, m, tb)
            assert tb.group * tb.rows * 2 <= isa.vector_registers // 2, (tier, m, tb)    # accumulators in registers
        assert (4099 // tiled_blocking(isa, 5, 4099).chunk) % tiled_blocking(isa, 5, 4099).tile_steps, tier
