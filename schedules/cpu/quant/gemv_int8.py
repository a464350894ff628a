"""Decode GEMV over Q3_K / Q4_K / Q5_K / Q6_K (and Q4_0: quant/q4_0_int8.py's macros in these loops) with int8 activations:
integer dot products, as llama.cpp's CPU kernels do.

Why (each CPU GEMV type should read at >= 80% of the DRAM read): gemv_quant.py turns every weight into an fp32
lane (table lookup + FMA per 16 weights), and on the GPU machine's Xeon that kept Q4_K at 58 and Q6_K at 65
GB/s of quantized bytes where the DRAM read is 100: the cores, not DRAM, were the limit. Here x is quantized
once per call to int8 (one scale per 256-weight block, llama.cpp's Q8_K), and a 64-weight slice of a row costs
two integer instructions: vpmaddubsw (unsigned 4/6-bit quant x signed int8 x -> int16 pairs, which cannot
saturate: 2 * 63 * 127 < 2^15) and vpdpwssd (int16 pairs x the sub-blocks' int16 scales, summed into int32
lanes; vpmaddwd + vpaddd where the CPU lacks AVX512-VNNI, the same integers). One fp32 FMA per block and row
then applies d * dx. Products and sums are exact integers, so the kernel equals dequant(W) @ (xq * dx) up to
fp32 rounding of the per-block terms (~1e-7); against fp32 x the int8 rounding of x costs ~5e-3 of max |y|,
what llama.cpp's CPU path costs too.

Layouts (ggml-common.h; see gemv_quant.py): a 64-byte window of quants is four 16-lane int32 groups.
- q4_k: window w (bytes 32w*2 .. +64 of the 128) holds chunks 2w and 2w+1; its low nibbles are sub-blocks 4w
  (lanes 0-7) and 4w+2 (lanes 8-15), its high nibbles 4w+1 and 4w+3. x is stored permuted per block to that
  product order (xq: [sb0 | sb2 | sb1 | sb3 | sb4 | sb6 | sb5 | sb7]). The mins term dmin * m_j * sum_j(x) uses
  the int8 x's sums times dx (xs), one 8-lane FMA per block and row.
- q5_k: q4_k's order and arithmetic; each 64-byte window's nibbles OR the fifth bits in, from the block's 32
  qh bytes (byte p % 32, bit 2c + t for chunk c, nibble t) shifted per 32-byte half of the window.
- q6_k: half h's 64 ql bytes have weights 128h + 0..63 in their low nibbles and 128h + 64..127 in their high
  ones, so x keeps its natural order; the 2-bit highs of byte l of the half's 32 qh bytes shift into place
  with one variable 16-bit shift per product (vpsllvw / vpsrlvw). q - 32 is q * x summed, minus 32 * sc_j *
  (sum of x over sub-block j), the latter one vpmaddwd per block and row over per-call int16 sums (xs).
- q3_k: q6_k's product order and offset arithmetic (q - 4); product g = 2h + t covers weights 128h + 64t + 0..63,
  whose 2-bit fields are bits 2c of qs byte 32h + p % 32 and whose third bits are bit 4h + c of hmask byte p % 32
  (c = 2t + p // 32), both moved into place by q6_k's per-half 16-bit shifts; the 6-bit scales minus 32 become
  16 int16 lanes once per block and row.
m tokens: the quants and scales of a block row are decoded once for all tokens; each token's sums are formed
the same way for every m, so y[t] is bit-identical to the m = 1 kernel's on x[t] alone (batch invariance).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.gemv_quant import (DEFAULT_TUNING, QuantGemvTuning, _check, _hsum, _sum, _token,
                                            gemv_quant_symbol, quant_blocking)
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.prefetch import prefetch_macro as _prefetch
from helmc.schedules.cpu.quant.mxfp4_int8 import UNIT as MXFP4_UNIT, UNIT_BYTES as MXFP4_UNIT_BYTES, mxfp4_row, quantize_mxfp4
from helmc.schedules.cpu.quant.q4_0_int8 import UNIT as Q4_0_UNIT, UNIT_BYTES as Q4_0_UNIT_BYTES, q4_0_row, quantize_q4_0
from helmc.schedules.cpu.quant.tiles import QuantTiles
from helmc.schedules.cpu.weight_load import STACK, widen


@dataclass(frozen=True)
class Int8Unit:
    """What the int8 kernels step over along K for one type: a K-quant block, or four Q4_0 blocks (q4_0_int8.py)."""
    weights: int      # weights per unit
    bytes: int        # W bytes per unit and row
    dx_lanes: int     # x scales per unit and token (dx: [m, units * dx_lanes])
    sums: int         # x sums per unit and token (xs: [m, units * sums])
    xs_dtype: str
    mins: bool        # accm holds a term subtracted from each row's sum

    @property
    def x_bytes(self) -> int:
        """One token's quantized-x bytes read per unit: int8 x, fp32 scales, sums."""
        return self.weights + 4 * self.dx_lanes + self.sums * (2 if self.xs_dtype == "int16" else 4)


INT8_UNITS = {"q3_k": Int8Unit(256, 110, 1, 16, "int16", True),
              "q4_k": Int8Unit(256, 144, 1, 8, "float32", True), "q5_k": Int8Unit(256, 176, 1, 8, "float32", True),
              "q6_k": Int8Unit(256, 210, 1, 16, "int16", True),
              "q4_0": Int8Unit(Q4_0_UNIT, Q4_0_UNIT_BYTES, 16, 16, "int32", False),
              "mxfp4": Int8Unit(MXFP4_UNIT, MXFP4_UNIT_BYTES, 16, 16, "int32", False)}
INT8_QTYPES = tuple(INT8_UNITS)
# Rows per step for one token (quant_blocking divides them among more tokens) and prefetch distance, per type: the
# best of the variants timed on the GPU machine's 16-core Xeon (one run, best of
# 5 passes, 12288 x 4096 over 4x L3 beside helmc's stream read): Q4_K 8 rows / 1 KiB 85.2 GB/s (0.76 of the read;
# 4 rows / 2 KiB 79.1, 8 rows / 2 KiB 78.3), Q6_K 4 rows / 1 KiB 109.9 (0.96; 8 rows / 2 KiB 99.5). On the 2-core
# EPYC (one thread, from cache) 8 rows also beat 4 for Q4_K (33-36 against 30 GB/s): more rows give the core
# independent work beside each block's chain of integer steps.
# Q4_0: 8 rows as Q4_K (its unit is as short: 72 bytes against 144, the same per-row chain of integer steps), its
# lines 2 KiB ahead into L2 (one run: 108.5 GB/s, 0.82 of a 133 GB/s read beside it, against 88.0 and
# 0.62 for 1 KiB into L1; another: 0.83 against 0.75).
# In the second run (7 rounds beside a 106-119 GB/s read): prefetching into L2 rather than L1 also won for Q4_K
# (8 rows / 1 KiB: 0.81 against 0.71; 4 / 8 / 16 KiB or 4 / 16 rows 0.72-0.77) and Q6_K (4 rows / 2 KiB: 0.90
# against 0.86 for 1 KiB into L1; 0.93 against 0.89 in the first): the lines ahead no longer evict the int8 x and the
# scales every row reads from the 48 KiB L1.
# Q5_K: Q4_K's (its loop plus one byte shift, mask and OR per 64 weights for the fifth bit; not timed apart yet).
# Q3_K: Q6_K's (the same loop over 16-weight sub-blocks and the same offset term; not timed apart yet).
INT8_TUNING = {"q3_k": QuantGemvTuning(rows=4, prefetch_bytes=2048, prefetch_locality=2),
               "q4_k": QuantGemvTuning(rows=8, prefetch_bytes=1024, prefetch_locality=2),
               "q5_k": QuantGemvTuning(rows=8, prefetch_bytes=1024, prefetch_locality=2),
               "q6_k": QuantGemvTuning(rows=4, prefetch_bytes=2048, prefetch_locality=2),
               "q4_0": QuantGemvTuning(rows=8, prefetch_bytes=2048, prefetch_locality=2),
               "mxfp4": QuantGemvTuning(rows=8, prefetch_bytes=2048, prefetch_locality=2)}   # Q4_0's: not timed apart
_BLOCK = 256          # weights per K-quant block, and per scale of the int8 x


def int8_gemv_applies(qtype: str, isa: VectorIsa, k: int) -> bool:
    """AVX-512 (BW's byte and word instructions) runs Q3_K, Q4_K, Q5_K, Q6_K, Q4_0 and MXFP4 through int8 dot products,
    Q4_0 where K is whole units of four blocks (every real model's; tiny test models may have K = 32 or 64), MXFP4 of
    two."""
    return isa.tier == "avx512" and qtype in INT8_UNITS and k % INT8_UNITS[qtype].weights == 0


def _macros(qtype: str, isa: VectorIsa, group: int, m: int):
    """(quantize, row_dot) macros of qtype's int8 kernel. A row_dot's per-block values (scales, mins, quants) are
    T.meta_var expressions, not `v = expr` locals: TVMScript makes such a local a one-element buffer, which TVM lowers
    to a TVMBackendAllocWorkspace call and its free in every iteration of the parallel loop around it (the MoE expert
    kernels run a step's row_dot in several tile sizes: 17-100+ pool calls per step, a quarter of their time)."""
    vnni = "avx512_vnni" in isa.required_flags
    if qtype == "q4_0":
        return quantize_q4_0(_max_tree), q4_0_row(vnni, group, m, _token)
    if qtype == "mxfp4":
        return quantize_mxfp4(_max_tree), mxfp4_row(vnni, group, m, _token)
    if qtype in ("q4_k", "q5_k"):
        return _quantize(True), _q4_k_row(_dot_step(vnni), isa, group, m, fifth_bit=qtype == "q5_k")
    if qtype == "q3_k":
        return _quantize(False), _q3_k_row(_dot_step(vnni), isa, group, m)
    return _quantize(False), _q6_k_row(_dot_step(vnni), isa, group, m)


def _ramp(base, lanes: int):
    return tirx.Ramp(base, 1, lanes)


def _bcast(value, lanes: int):
    return tirx.Broadcast(value, lanes)


def _const(value, dtype: str, lanes: int):
    return tirx.Broadcast(tirx.const(value, dtype), lanes)


def _halves(first: int, second: int, dtype: str, lanes: int):
    """A vector constant: `first` in the low half of the lanes, `second` in the high half (shift counts)."""
    return tirx.Shuffle([_const(first, dtype, lanes // 2), _const(second, dtype, lanes // 2)], list(range(lanes)))


def _dot_step(vnni: bool):
    """acc (int32x16) + pairs(maddubs(u, s)) * scales: vpdpwssd, or vpmaddwd + vpaddd without VNNI."""
    def step(acc, unsigned, signed, scales):
        pairs = tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.pmaddubs.w.512", unsigned, signed)
        if vnni:
            return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpwssd.512", acc, pairs, scales)
        return acc + tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", pairs, scales)
    return step


def _hmax(v):
    lanes = v.ty.dtype.lanes
    total = tirx.Shuffle([v], [0])
    for i in range(1, lanes):
        total = tirx.max(total, tirx.Shuffle([v], [i]))
    return total


def _isum(v):
    return _sum([tirx.Shuffle([v], [i]) for i in range(v.ty.dtype.lanes)])


def make_gemv_quant_int8(qtype: str, n: int, k: int, isa: VectorIsa,
                         tuning: QuantGemvTuning = DEFAULT_TUNING, m: int = 1) -> tirx.PrimFunc:
    """PrimFunc(x: float32[m, k], w: uint8[n, row_bytes], y: float32[m, n]): y = (xq * dx) @ dequant(w)^T.

    x is quantized per token and 256-weight block (Q4_0, MXFP4: per 32-weight block, each dx in the 4 lanes of its block):
    dx = max|x| / 127, xq = rint(x * (127 / max|x|)) (0 for an all-zero block). Same symbol and signature as
    gemv_quant.make_gemv_quant_float (decode_gemv picks one).
    """
    _check(qtype, n, k)
    assert int8_gemv_applies(qtype, isa, k), (qtype, isa.tier, k)
    tuning = INT8_TUNING[qtype] if tuning == DEFAULT_TUNING else tuning
    assert m >= 1, m
    if m > 1:
        return _make_int8_tiled(qtype, n, k, isa, tuning, m).with_attr("global_symbol",
                                                                        gemv_quant_symbol(qtype, n, k, m))
    rows, _ = quant_blocking(qtype, 1, isa, tuning)
    unit = INT8_UNITS[qtype]
    blocks = k // unit.weights
    row_bytes = blocks * unit.bytes
    steps = -(-n // rows)
    quantize, _ = _macros(qtype, isa, 1, 1)
    step_rows = one_token_step(qtype, n, k, isa, tuning)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, row_bytes), "uint8"), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wi = T.decl_buffer((n, row_bytes), "int8", data=w.data)
        wh = T.decl_buffer((n, row_bytes // 2), "float16", data=w.data)   # [n, row_bytes / 2]: fp16 fields
        wf = T.decl_buffer((n * row_bytes,), "uint8", data=w.data)        # [n * row_bytes]: prefetch addresses
        wu = T.decl_buffer((n, row_bytes // 4), "uint32", data=w.data)    # [n, row_bytes / 4]: q4_k's scale words
        xq = T.alloc_buffer((m, k), "int8")
        dx = T.alloc_buffer((m, blocks * unit.dx_lanes), "float32")
        xs = T.alloc_buffer((m, blocks * unit.sums), unit.xs_dtype)
        for b in T.serial(blocks):
            quantize(x, xq, dx, xs, 0, b)
        for step in T.parallel(steps):
            step_rows(w, wi, wh, wf, wu, xq, dx, xs, y, step)

    return gemv.with_attr("global_symbol", gemv_quant_symbol(qtype, n, k, m))


def one_token_step(qtype: str, n: int, k: int, isa: VectorIsa, tuning: QuantGemvTuning = DEFAULT_TUNING):
    """The one-token kernel's parallel step over a weight of n rows, as a macro (w, its int8 / fp16 / byte / uint32
    views, the quantized x's xq, dx, xs, y [1, n], step): `rows` rows' dot products over every block, written to y.
    make_gemv_quant_int8 (m = 1) runs it over its weight, gemv_int8_multi over each of its weights."""
    tuning = INT8_TUNING[qtype] if tuning == DEFAULT_TUNING else tuning
    _check(qtype, n, k)
    unit = INT8_UNITS[qtype]
    rows, group = quant_blocking(qtype, 1, isa, tuning)
    assert group == 1, group
    blocks = k // unit.weights
    prefetch = _prefetch(rows, unit.bytes, blocks * unit.bytes, tuning, n)
    _, row_dot = _macros(qtype, isa, 1, 1)

    @T.macro
    def step_rows(w, wi, wh, wf, wu, xq, dx, xs, y, step):
        acc = T.alloc_buffer((1, rows, 16), "float32", scope="global", annotations=STACK)
        accm = T.alloc_buffer((1, rows, 8), "float32", scope="global", annotations=STACK)
        for r in T.unroll(rows):
            acc[0, r, _ramp(0, 16)] = _const(0.0, "float32", 16)
            accm[0, r, _ramp(0, 8)] = _const(0.0, "float32", 8)
        for b in T.serial(blocks):
            prefetch(wf, step * rows, b)
            for r in T.unroll(rows):
                row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, T.min(step * rows + r, n - 1), r, b, 0)
        for r in T.unroll(rows):
            if step * rows + r < n:
                if unit.mins:
                    y[0, step * rows + r] = _hsum(acc[0, r, _ramp(0, 16)]) - _hsum(accm[0, r, _ramp(0, 8)])
                else:
                    y[0, step * rows + r] = _hsum(acc[0, r, _ramp(0, 16)])
    return step_rows


def int8_tiles(qtype: str, m: int, k: int, isa: VectorIsa, tuning: QuantGemvTuning = DEFAULT_TUNING) -> QuantTiles:
    """The m > 1 loop of make_gemv_quant_int8 (x read per unit and token: Int8Unit.x_bytes)."""
    tuning = INT8_TUNING[qtype] if tuning == DEFAULT_TUNING else tuning
    unit = INT8_UNITS[qtype]
    return QuantTiles.make(*quant_blocking(qtype, m, isa, tuning), m, k // unit.weights, unit.x_bytes, 16)


def _make_int8_tiled(qtype: str, n: int, k: int, isa: VectorIsa, tuning: QuantGemvTuning, m: int):
    """m > 1: quant/tiles.QuantTiles' order over the same prologue and row_dot (each token's sums as at m = 1)."""
    _check(qtype, n, k)
    unit = INT8_UNITS[qtype]
    blocks = k // unit.weights
    row_bytes = blocks * unit.bytes
    qt = int8_tiles(qtype, m, k, isa, tuning)
    rows, group, rb, tile = qt.rows, qt.group, qt.block_rows, qt.tile_blocks
    passes, tiles = qt.passes(m), -(-blocks // qt.tile_blocks)
    prefetch = _prefetch(rows, unit.bytes, row_bytes, tuning, n, ahead=tile * unit.bytes, wrap_rows=rb)
    quantize, row_dot = _macros(qtype, isa, group, m)
    zero, load, save, finish = qt.macros(m, unit.mins)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, row_bytes), "uint8"), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wi = T.decl_buffer((n, row_bytes), "int8", data=w.data)
        wh = T.decl_buffer((n, row_bytes // 2), "float16", data=w.data)
        wf = T.decl_buffer((n * row_bytes,), "uint8", data=w.data)
        wu = T.decl_buffer((n, row_bytes // 4), "uint32", data=w.data)
        xq = T.alloc_buffer((m, k), "int8")
        dx = T.alloc_buffer((m, blocks * unit.dx_lanes), "float32")
        xs = T.alloc_buffer((m, blocks * unit.sums), unit.xs_dtype)
        for t in T.serial(m):
            for b in T.serial(blocks):
                quantize(x, xq, dx, xs, t, b)
        for step in T.parallel(-(-n // rb)):
            accs = T.alloc_buffer((rb, passes * group, 16), "float32", scope="global", annotations=STACK)
            accms = T.alloc_buffer((rb, passes * group, 8), "float32", scope="global", annotations=STACK)
            zero(accs, accms)
            for kt in T.serial(tiles):
                for rg in T.serial(T.min(rb // rows, (n - step * rb + rows - 1) // rows)):
                    for p in T.serial(passes):
                        acc = T.alloc_buffer((group, rows, 16), "float32", scope="global", annotations=STACK)
                        accm = T.alloc_buffer((group, rows, 8), "float32", scope="global", annotations=STACK)
                        load(accs, accms, acc, accm, rg, p)
                        for bi in T.serial(T.min(tile, blocks - kt * tile)):
                            prefetch(wf, step * rb + rg * rows, kt * tile + bi)
                            for r in T.unroll(rows):
                                row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm,
                                        T.min(step * rb + rg * rows + r, n - 1), r, kt * tile + bi, p)
                        save(accs, accms, acc, accm, rg, p)
            finish(accs, accms, y, n, step * rb)

    return gemv


def _q4k_slot(v: int) -> int:
    """Position (in 16-weight vectors) of the block's x vector v in q4_k's product order: sub-block j = v // 2
    goes to product g = 2 * (j // 4) + j % 2, half (j % 4) // 2."""
    j, part = v // 2, v % 2
    return (2 * (j // 4) + j % 2) * 4 + (j % 4) // 2 * 2 + part


def _quantize(q4k: bool):
    """Macro: token t's block b of x -> xq (int8, q4_k's product order or natural), dx, and the sums xs
    (q4_k: dx * sum of xq per sub-block of 32, fp32; q6_k: sum of xq per 16, int16)."""
    @T.macro
    def quantize(x, xq, dx, xs, t, b):
        amax = _max_tree([tirx.abs(x[t, _ramp(b * _BLOCK + v * 16, 16)]) for v in range(16)])
        inv = T.if_then_else(amax > T.float32(0), T.float32(127) / amax, T.float32(0))
        dx[t, b] = amax / T.float32(127)
        for v in T.unroll(16):
            xq[t, _ramp(b * _BLOCK + (_q4k_slot(v) if q4k else v) * 16, 16)] = tirx.Cast("int8x16", tirx.Cast(
                "int32x16", tirx.nearbyint(x[t, _ramp(b * _BLOCK + v * 16, 16)] * _bcast(inv, 16))))
        if q4k:
            for j in T.unroll(8):
                xs[t, b * 8 + j] = dx[t, b] * tirx.Cast("float32", _isum(
                    tirx.Cast("int32x16", xq[t, _ramp(b * _BLOCK + _q4k_slot(2 * j) * 16, 16)])
                    + tirx.Cast("int32x16", xq[t, _ramp(b * _BLOCK + _q4k_slot(2 * j + 1) * 16, 16)])))
        else:
            for j in T.unroll(16):
                xs[t, b * 16 + j] = tirx.Cast("int16", _isum(tirx.Cast(
                    "int32x16", xq[t, _ramp(b * _BLOCK + j * 16, 16)])))

    return quantize


def _max_tree(terms):
    while len(terms) > 1:
        terms = [tirx.max(terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return _hmax(terms[0])


def _q4_k_row(dot_step, isa: VectorIsa, group: int, m: int, fifth_bit: bool = False):
    """Macro: one block of one row, every token of the pass. The 12 scale bytes s[0..12) hold, for i < 4:
    sc_i = s[i] & 63, m_i = s[4+i] & 63, sc_{4+i} = (s[8+i] & 15) | (s[i] >> 6) << 4,
    m_{4+i} = (s[8+i] >> 4) | (s[4+i] >> 6) << 4 (ggml's get_scale_min_k4).
    fifth_bit: q5_k's blocks (176 B: qh[32] at byte 16, the nibbles at 48); byte p of window w, nibble t gains
    16 * bit 4w + 2(p // 32) + t of qh[p % 32] (q < 32: maddubs' pairs 2 * 31 * 127 stay inside int16)."""
    f16c = not isa.is_slow_fallback
    bb, qs = (176, 48) if fifth_bit else (144, 16)       # block bytes, offset of the nibbles

    def fifth(w, row, b, g):
        qh = w[row, _ramp(b * bb + 16, 32)]                                        # uint8x32
        shift = lambda c: tirx.shift_right(qh, _const(4 * (g // 2) + 2 * c + g % 2, "uint8", 32))
        bits = tirx.Shuffle([shift(0), shift(1)], list(range(64)))                 # bytes p < 32: chunk 2w, else 2w + 1
        return tirx.shift_left(tirx.bitwise_and(bits, _const(1, "uint8", 64)), _const(4, "uint8", 64))

    def nibbles(w, row, b, g):
        window = w[row, _ramp(b * bb + qs + g // 2 * 64, 64)]                   # uint8x64
        if g % 2 == 0:
            q = tirx.bitwise_and(window, _const(15, "uint8", 64))
        else:
            q = tirx.shift_right(window, _const(4, "uint8", 64))
        return tirx.bitwise_or(q, fifth(w, row, b, g)) if fifth_bit else q

    @T.macro
    def row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p):
        d = T.meta_var(widen(wh[row, b * (bb // 2)], "float16", f16c))
        dmin = T.meta_var(widen(wh[row, b * (bb // 2) + 1], "float16", f16c))
        # The 12 scale bytes as words u0, u1, u2 (and the block's first quant word, unused) in one 128-bit vector,
        # get_scale_min_k4 by llama.cpp's kmask trick on its lanes: unpacked in scalar words, the fields then moved
        # into a vector two port-5 uops a word, on the port the scale broadcasts below already fill (llvm-mca:
        # 153 -> 132 cycles per 8 row-blocks).
        u = T.meta_var(wu[row, _ramp(b * (bb // 4) + 1, 4)])                            # uint32x4
        u2 = T.meta_var(tirx.Shuffle([u], [2, 2, 2, 2]))
        low = T.meta_var(tirx.bitwise_and(u, _const(0x3F3F3F3F, "uint32", 4)))        # sc0-3 | m0-3 | - | -
        high = T.meta_var(tirx.bitwise_or(                                             # sc4-7 | m4-7 | - | -
            tirx.bitwise_and(tirx.shift_right(u2, tirx.Shuffle([_const(0, "uint32", 2), _const(4, "uint32", 2)],
                                                               [0, 2, 1, 3])), _const(0x0F0F0F0F, "uint32", 4)),
            tirx.shift_left(tirx.bitwise_and(tirx.shift_right(u, _const(6, "uint32", 4)),
                                             _const(0x03030303, "uint32", 4)), _const(4, "uint32", 4))))
        fields = T.meta_var(tirx.reinterpret("uint8x16", tirx.Shuffle([low, high], [0, 4, 1, 5])))  # sc0-7 | m0-7
        scales = T.meta_var(tirx.Cast("int16x8", tirx.Shuffle([fields], list(range(8)))))
        mins = T.meta_var(tirx.Cast("float32x8", tirx.Shuffle([fields], list(range(8, 16)))) * _bcast(dmin, 8))
        for s in T.unroll(group):
            acc[s, r, _ramp(0, 16)] = acc[s, r, _ramp(0, 16)] + tirx.Cast("float32x16", _chain(
                dot_step, [nibbles(w, row, b, g) for g in range(4)],
                [xq[_token(p, s, group, m), _ramp(b * _BLOCK + g * 64, 64)] for g in range(4)],
                [tirx.Shuffle([scales] * 4, [2 * (g // 2) * 2 + g % 2] * 16 + [2 * (g // 2) * 2 + 2 + g % 2] * 16)
                 for g in range(4)])) * _bcast(d * dx[_token(p, s, group, m), b], 16)
            accm[s, r, _ramp(0, 8)] = accm[s, r, _ramp(0, 8)] + mins * xs[_token(p, s, group, m), _ramp(b * 8, 8)]

    return row_dot


def _q6_k_row(dot_step, isa: VectorIsa, group: int, m: int):
    """Macro: one block of one row, every token of the pass. Product g = 2h + t covers weights 128h + 64t
    + 0..63: ql's nibble t of bytes 64h + 0..63, and from qh byte l = p % 32 of the half, bits 2c..2c+1 with
    c = 2t + p // 32, moved to bits 4-5 of each byte by a 16-bit shift whose count differs between the two
    32-byte halves of the window (the bits that cross into the neighbouring byte are masked off)."""
    f16c = not isa.is_slow_fallback
    left = _halves(4, 2, "uint16", 32)    # t = 0: bits 0-1 (p < 32) and 2-3 (p >= 32) -> 4-5
    right = _halves(0, 2, "uint16", 32)   # t = 1: bits 4-5 and 6-7 -> 4-5

    def quants(w, row, b, g):
        h, t = g // 2, g % 2
        ql = w[row, _ramp(b * 210 + h * 64, 64)]                                        # uint8x64
        qh = w[row, _ramp(b * 210 + 128 + h * 32, 32)]                                  # uint8x32
        both = tirx.reinterpret("uint16x32", tirx.Shuffle([qh, qh], list(range(64))))   # uint8x64 -> uint16x32
        moved = tirx.shift_left(both, left) if t == 0 else tirx.shift_right(both, right)
        high = tirx.bitwise_and(tirx.reinterpret("uint8x64", moved), _const(0x30, "uint8", 64))
        low = tirx.bitwise_and(ql, _const(15, "uint8", 64)) if t == 0 else tirx.shift_right(ql, _const(4, "uint8", 64))
        return tirx.bitwise_or(low, high)

    @T.macro
    def row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p):
        d = T.meta_var(widen(wh[row, b * 105 + 104], "float16", f16c))
        scales = T.meta_var(tirx.Cast("int16x16", wi[row, _ramp(b * 210 + 192, 16)]))
        for s in T.unroll(group):
            acc[s, r, _ramp(0, 16)] = acc[s, r, _ramp(0, 16)] + tirx.Cast("float32x16", _chain(
                dot_step, [quants(w, row, b, g) for g in range(4)],
                [xq[_token(p, s, group, m), _ramp(b * _BLOCK + g * 64, 64)] for g in range(4)],
                [tirx.Shuffle([scales] * 2, [g * 4 + lane // 8 for lane in range(32)]) for g in range(4)])
            ) * _bcast(d * dx[_token(p, s, group, m), b], 16)
            accm[s, r, _ramp(0, 8)] = accm[s, r, _ramp(0, 8)] + tirx.Cast("float32x8", tirx.call_llvm_pure_intrin(
                "int32x8", "llvm.x86.avx2.pmadd.wd", scales, xs[_token(p, s, group, m), _ramp(b * 16, 16)])
            ) * _bcast(T.float32(32) * d * dx[_token(p, s, group, m), b], 8)

    return row_dot


def _q3_k_row(dot_step, isa: VectorIsa, group: int, m: int):
    """Macro: one block of one row (110 B: hmask[32], qs[64] at 32, scales[12] at 96, d at 108), every token of the
    pass. Product g = 2h + t: weights 128h + 64t + p (p < 64) are q = (bits 2c of qs[32h + p % 32]) | (bit 4h + c
    of hmask[p % 32]) << 2 with c = 2t + p // 32, so each 32-byte source is read twice into the 64 lanes and
    shifted per half (bits crossing into the neighbouring byte are masked off); w = d * (sc_j - 32) * (q - 4)."""
    f16c = not isa.is_slow_fallback
    sc_shift = tirx.Shuffle([_const(2 * i, "int16", 4) for i in range(4)], list(range(16)))   # byte j % 4, bits 2(j // 4)

    def twice(w, row, at, g, first):
        """uint8x64: the 32 bytes at `at` in both halves, shifted right by `first` (p < 32) and first + 1 or + 2."""
        src = w[row, _ramp(at, 32)]
        both = tirx.reinterpret("uint16x32", tirx.Shuffle([src, src], list(range(64))))
        return tirx.reinterpret("uint8x64", tirx.shift_right(both, _halves(first[0], first[1], "uint16", 32)))

    def quants(w, row, b, g):
        h, t = g // 2, g % 2
        low = tirx.bitwise_and(twice(w, row, b * 110 + 32 + 32 * h, g, (4 * t, 4 * t + 2)), _const(3, "uint8", 64))
        third = tirx.bitwise_and(twice(w, row, b * 110, g, (4 * h + 2 * t, 4 * h + 2 * t + 1)), _const(1, "uint8", 64))
        return tirx.bitwise_or(low, tirx.shift_left(third, _const(2, "uint8", 64)))

    def scales(w, row, b):
        """int16x16: sc_j - 32 for the 16 sub-blocks."""
        lo = w[row, _ramp(b * 110 + 96, 8)]
        nib = tirx.Shuffle([tirx.bitwise_and(lo, _const(15, "uint8", 8)), tirx.shift_right(lo, _const(4, "uint8", 8))],
                           list(range(16)))
        top = tirx.Cast("int16x16", tirx.Shuffle([w[row, _ramp(b * 110 + 104, 4)]] * 4, list(range(16))))
        top = tirx.bitwise_and(tirx.shift_right(top, sc_shift), _const(3, "int16", 16))
        return tirx.bitwise_or(tirx.Cast("int16x16", nib), tirx.shift_left(top, _const(4, "int16", 16))) \
            - _const(32, "int16", 16)

    @T.macro
    def row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p):
        d = T.meta_var(widen(wh[row, b * 55 + 54], "float16", f16c))
        sc = T.meta_var(scales(w, row, b))
        for s in T.unroll(group):
            acc[s, r, _ramp(0, 16)] = acc[s, r, _ramp(0, 16)] + tirx.Cast("float32x16", _chain(
                dot_step, [quants(w, row, b, g) for g in range(4)],
                [xq[_token(p, s, group, m), _ramp(b * _BLOCK + g * 64, 64)] for g in range(4)],
                [tirx.Shuffle([sc] * 2, [g * 4 + lane // 8 for lane in range(32)]) for g in range(4)])
            ) * _bcast(d * dx[_token(p, s, group, m), b], 16)
            accm[s, r, _ramp(0, 8)] = accm[s, r, _ramp(0, 8)] + tirx.Cast("float32x8", tirx.call_llvm_pure_intrin(
                "int32x8", "llvm.x86.avx2.pmadd.wd", sc, xs[_token(p, s, group, m), _ramp(b * 16, 16)])
            ) * _bcast(T.float32(4) * d * dx[_token(p, s, group, m), b], 8)

    return row_dot


def _chain(dot_step, unsigned, signed, scales):
    """The block's four 64-weight products summed as two chains of two (integer sums: the order cannot change
    the result, and two chains halve the block's dependent vpdpwssd latency)."""
    halves = []
    for first in (0, 2):
        total = _const(0, "int32", 16)
        for g in (first, first + 1):
            total = dot_step(total, unsigned[g], signed[g], scales[g])
        halves.append(total)
    return halves[0] + halves[1]
