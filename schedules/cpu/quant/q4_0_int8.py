"""Q4_0 on the int8 path of quant/gemv_int8.py: four 32-weight blocks (72 bytes, 128 weights) per step unit.

Why (each CPU GEMV type should read at >= 80% of the DRAM read): the fp32-lane Q4_0 kernel (gemv_quant.py) spends a
table lookup and an FMA per 16 weights and a scale FMA per 32, and on the GPU machine's Xeon it read 0.57 of the
stream read where the int8 K-quants read 0.68-0.86. Here, as llama.cpp's vec_dot_q4_0_q8_0 does,
x is quantized to int8 per 32-weight block (Q8_0's granularity: one dx per weight block, so no block's product mixes
two x scales) and four weight blocks are one 512-bit step:
- the unit's 72 bytes are two overlapping 64-byte loads; one byte shuffle (vpermt2b where the CPU has VBMI) gathers
  the four blocks' 16 quant bytes, one word shuffle of the first load the four fp16 scales, each into 4 lanes;
- low nibbles are weights 0-15 of each block, high nibbles 16-31 (ggml's block_q4_0), so x is stored per unit as
  [block 0..3 weights 0-15 | block 0..3 weights 16-31] and both halves multiply their nibbles directly;
- q - 8 costs nothing in the loop: the dot product chain starts from -8 * (sum of the 8 x bytes of each int32
  lane), formed once per call (xs), then adds the nibbles' products, vpdpbusd twice with AVX512-VNNI (without it
  vpmaddubsw, vpmaddwd by ones, vpaddd per half: the same integers; a vpmaddubsw lane is at most 2 * 15 * 127 <
  2^15, so it cannot saturate);
- one convert and one FMA with d * dx (both per block, broadcast to the block's 4 lanes) per unit and row.
Products and sums are exact integers, so a row equals dequant(W) @ (xq * dx) up to the fp32 rounding of the
per-unit terms. The macros plug into gemv_int8's loops (one token and m-row tiles) by its row_dot interface.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

UNIT = 128            # weights per step unit: four Q4_0 blocks
UNIT_BYTES = 72
_WEIGHT_BLOCK = 32


def _ramp(base, lanes: int):
    return tirx.Ramp(base, 1, lanes)


def _const(value, dtype: str, lanes: int):
    return tirx.Broadcast(tirx.const(value, dtype), lanes)


def _lane_sums(v, groups: int, width: int):
    """int32x(groups) of the sums of `width` consecutive lanes of v (an int32 vector)."""
    total = tirx.Shuffle([v], [g * width for g in range(groups)])
    for j in range(1, width):
        total = total + tirx.Shuffle([v], [g * width + j for g in range(groups)])
    return total


def quantize_q4_0(tmax):
    """Macro: token t's unit b of x -> xq (int8, [lows of blocks 0-3 | highs of blocks 0-3]), dx [16 lanes: each
    block's max|x| / 127 in its 4 lanes] and xs (int32 [16]: -8 * the sum of the 8 x bytes lane l multiplies, bytes
    4l..4l+3 of both halves). tmax(terms) is gemv_int8's max tree (the K-quants' amax, the same rounding)."""
    @T.macro
    def quantize(x, xq, dx, xs, t, b):
        for i in T.unroll(4):
            amax = tmax([tirx.abs(x[t, _ramp(b * UNIT + i * _WEIGHT_BLOCK + h * 16, 16)]) for h in range(2)])
            inv = T.if_then_else(amax > T.float32(0), T.float32(127) / amax, T.float32(0))
            dx[t, _ramp(b * 16 + i * 4, 4)] = tirx.Broadcast(amax / T.float32(127), 4)
            for h in T.unroll(2):                 # h = 0: weights 0-15 of block i, h = 1: weights 16-31
                xq[t, _ramp(b * UNIT + h * 64 + i * 16, 16)] = tirx.Cast("int8x16", tirx.Cast(
                    "int32x16", tirx.nearbyint(x[t, _ramp(b * UNIT + i * _WEIGHT_BLOCK + h * 16, 16)]
                                               * tirx.Broadcast(inv, 16))))
            xs[t, _ramp(b * 16 + i * 4, 4)] = _const(-8, "int32", 4) * (
                _lane_sums(tirx.Cast("int32x16", xq[t, _ramp(b * UNIT + i * 16, 16)]), 4, 4)
                + _lane_sums(tirx.Cast("int32x16", xq[t, _ramp(b * UNIT + 64 + i * 16, 16)]), 4, 4))

    return quantize


def _dot(vnni: bool):
    """acc (int32x16) + sum over each 4 bytes of unsigned (uint8x64) * signed (int8x64)."""
    def dot(acc, unsigned, signed):
        if vnni:
            # This LLVM (TVM 0.27's) declares the byte operands <64 x i8>; older ones took <16 x i32>.
            return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, unsigned, signed)
        pairs = tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.pmaddubs.w.512", unsigned, signed)
        return acc + tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", pairs,
                                                _const(1, "int16", 32))
    return dot


# Bytes of the unit's quants: blocks 0-2 from the first load (bytes 0-63), block 3's bytes 56-71 from the second
# (bytes 8-71 of the unit, lanes 48-63 of it; shuffle lanes 64 + 48 ..).
_QUANT_LANES = [i * 18 + 2 + j for i in range(3) for j in range(16)] + [64 + 48 + j for j in range(16)]
_SCALE_LANES = [i * 9 for i in range(4) for _ in range(4)]     # fp16 words of the first load: d of blocks 0-3


def q4_0_row(vnni: bool, group: int, m: int, token):
    """Macro row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p) of gemv_int8 for Q4_0: unit b of one row,
    every token of pass p (token(p, s, group, m) picks the token, as gemv_quant._token); accm is not used."""
    dot = _dot(vnni)

    @T.macro
    def row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p):
        first = T.meta_var(w[row, _ramp(b * UNIT_BYTES, 64)])                                  # uint8x64: bytes 0-63
        second = T.meta_var(w[row, _ramp(b * UNIT_BYTES + 8, 64)])                             # uint8x64: bytes 8-71
        quants = T.meta_var(tirx.Shuffle([first, second], _QUANT_LANES))                       # uint8x64: 4 x 16 bytes
        low = T.meta_var(tirx.bitwise_and(quants, _const(15, "uint8", 64)))
        high = T.meta_var(tirx.shift_right(quants, _const(4, "uint8", 64)))
        d = T.meta_var(tirx.Cast("float32x16", tirx.Shuffle([tirx.reinterpret("float16x32", first)], _SCALE_LANES)))
        for s in T.unroll(group):
            acc[s, r, _ramp(0, 16)] = acc[s, r, _ramp(0, 16)] + tirx.Cast("float32x16", dot(dot(
                xs[token(p, s, group, m), _ramp(b * 16, 16)], low, xq[token(p, s, group, m), _ramp(b * UNIT, 64)]),
                high, xq[token(p, s, group, m), _ramp(b * UNIT + 64, 64)])) * (
                d * dx[token(p, s, group, m), _ramp(b * 16, 16)])

    return row_dot
