"""MXFP4 on the int8 path of quant/gemv_int8.py: two 32-weight blocks (34 bytes, 64 weights) per step unit.

Why: the routed experts of gpt-oss are MXFP4 and run on the CPU, through this kernel's one-token step in
quant/moe_experts.py (one call per block for every selected expert); the fp32-lane kernel (gemv_quant.py) spends a
table lookup and an FMA per 16 weights. As llama.cpp's vec_dot_mxfp4_q8_0 does, x is quantized to int8 per
32-weight block (one dx per weight block) and the e2m1 values are looked up as bytes:
- two blocks, not Q4_0's four, make the unit: gpt-oss's K (2880) is 90 blocks, whole pairs but not quads;
- the unit's 34 bytes are two overlapping 32-byte loads (bytes 0-31 and 2-33: never past the unit), one byte shuffle
  gathers both blocks' 16 quant bytes, and the low and high nibbles side by side are one 64-byte vector
  [block 0 weights 0-15 | block 1 weights 0-15 | block 0 weights 16-31 | block 1 weights 16-31], x stored per unit
  in the same order;
- one vpshufb maps every nibble to kvalues_mxfp4 + 12 (0 .. 24, unsigned as vpdpbusd wants it); the + 12 costs
  nothing in the loop: the dot product chain starts from -12 * (sum of the 4 x bytes of each int32 lane), formed
  once per call (xs), as Q4_0's - 8 does; vpdpbusd with AVX512-VNNI, else vpmaddubsw (at most 2 * 24 * 127 < 2^15:
  no saturation) and vpmaddwd by ones, the same integers;
- the e8m0 bytes' halved scales 2^(e - 128) (each in the 4 lanes of its block) by their float bits, one FMA with
  d * dx per unit and row.
Products and sums are exact integers and d is a power of two, so a row equals dequant(W) @ (xq * dx) up to the fp32
rounding of the per-unit terms.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.quant.mxfp4 import MXFP4_VALUES
from helmc.schedules.cpu.quant.q4_0_int8 import _const, _dot, _lane_sums, _ramp

UNIT = 64             # weights per step unit: two MXFP4 blocks
UNIT_BYTES = 34
_WEIGHT_BLOCK = 32
_OFFSET = 12          # kvalues_mxfp4 + 12 >= 0
# Bytes of the unit's quants: block 0's bytes 1-16 from the first load, block 1's bytes 18-33 from the second
# (bytes 2-33 of the unit: its lanes 16-31, shuffle lanes 32 + 16 ..).
_QUANT_LANES = [1 + j for j in range(16)] + [32 + 16 + j for j in range(16)]
# Each int32 lane's block (lanes 4i .. 4i + 3 hold bytes of block (i % 2)): e of block 0 is byte 0 of the first
# load, e of block 1 byte 17 of the unit, lane 15 of the second.
_SCALE_LANES = [0 if (i // 4) % 2 == 0 else 32 + 15 for i in range(16)]


def quantize_mxfp4(tmax):
    """Macro: token t's unit b of x -> xq (int8, the unit's order above), dx [16 lanes: each block's max|x| / 127 in
    its 4 lanes of both halves] and xs (int32 [16]: -12 * the sum of the 4 x bytes lane l multiplies). tmax(terms) is
    gemv_int8's max tree (the K-quants' amax, the same rounding)."""
    @T.macro
    def quantize(x, xq, dx, xs, t, b):
        for i in T.unroll(2):
            amax = tmax([tirx.abs(x[t, _ramp(b * UNIT + i * _WEIGHT_BLOCK + h * 16, 16)]) for h in range(2)])
            inv = T.if_then_else(amax > T.float32(0), T.float32(127) / amax, T.float32(0))
            for h in T.unroll(2):                 # h = 0: weights 0-15 of block i, h = 1: weights 16-31
                dx[t, _ramp(b * 16 + h * 8 + i * 4, 4)] = tirx.Broadcast(amax / T.float32(127), 4)
                xq[t, _ramp(b * UNIT + h * 32 + i * 16, 16)] = tirx.Cast("int8x16", tirx.Cast(
                    "int32x16", tirx.nearbyint(x[t, _ramp(b * UNIT + i * _WEIGHT_BLOCK + h * 16, 16)]
                                               * tirx.Broadcast(inv, 16))))
        xs[t, _ramp(b * 16, 16)] = _const(-_OFFSET, "int32", 16) * _lane_sums(
            tirx.Cast("int32x64", xq[t, _ramp(b * UNIT, 64)]), 16, 4)

    return quantize


def _table():
    """uint8x64: kvalues_mxfp4 + 12 in each 16-byte lane of vpshufb's table."""
    row = tirx.Shuffle([tirx.const(v + _OFFSET, "uint8") for v in MXFP4_VALUES], list(range(16)))
    return tirx.Shuffle([row] * 4, list(range(64)))


def _scales(first, second):
    """float32x16: 2^(e - 128) of each lane's block (ggml_e8m0_to_fp32_half), by its float bits."""
    e = tirx.Cast("int32x16", tirx.Shuffle([first, second], _SCALE_LANES))
    bits = tirx.Select(e < _const(2, "int32", 16), tirx.shift_left(_const(0x00200000, "int32", 16), e),
                       tirx.shift_left(e - _const(1, "int32", 16), _const(23, "int32", 16)))
    return tirx.reinterpret("float32x16", bits)


def mxfp4_row(vnni: bool, group: int, m: int, token):
    """Macro row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p) of gemv_int8 for MXFP4: unit b of one row,
    every token of pass p (token(p, s, group, m) picks the token, as gemv_quant._token); accm is not used."""
    dot = _dot(vnni)

    @T.macro
    def row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, row, r, b, p):
        first = T.meta_var(w[row, _ramp(b * UNIT_BYTES, 32)])                                  # uint8x32: bytes 0-31
        second = T.meta_var(w[row, _ramp(b * UNIT_BYTES + 2, 32)])                             # uint8x32: bytes 2-33
        quants = T.meta_var(tirx.Shuffle([first, second], _QUANT_LANES))                       # uint8x32: 2 x 16 bytes
        nibbles = T.meta_var(tirx.Shuffle([tirx.bitwise_and(quants, _const(15, "uint8", 32)),
                                            tirx.shift_right(quants, _const(4, "uint8", 32))], list(range(64))))
        values = T.meta_var(tirx.call_llvm_pure_intrin("uint8x64", "llvm.x86.avx512.pshuf.b.512", _table(), nibbles))
        d = T.meta_var(_scales(first, second))
        for s in T.unroll(group):
            acc[s, r, _ramp(0, 16)] = acc[s, r, _ramp(0, 16)] + tirx.Cast("float32x16", dot(
                xs[token(p, s, group, m), _ramp(b * 16, 16)], values, xq[token(p, s, group, m), _ramp(b * UNIT, 64)])
            ) * (d * dx[token(p, s, group, m), _ramp(b * 16, 16)])

    return row_dot
