"""MXFP4 (OCP microscaling FP4, gpt-oss's experts) in the fp32-lane decode GEMV (gemv_quant.py's block dots).

Block (17 B / 32 w, ggml's block_mxfp4): e (one e8m0 byte), then 16 bytes of e2m1 nibbles, byte i holding weight i
in its low nibble and weight i + 16 in its high one (q4_0's layout). w = kvalues_mxfp4[q] * 2^(e - 128):
kvalues_mxfp4 is e2m1 doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same negated: bit 3 is the sign), so the scale is
e8m0's 2^(e - 127) halved, ggml_e8m0_to_fp32_half: the float whose exponent field is e - 1, or for e < 2 the
subnormals 2^-128 (bits 1 << 21) and 2^-127 (1 << 22). Every product value * scale is exact in fp32.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.quant.float_lanes import _token, _Vectors, table_value
from helmc.schedules.cpu.quant.tiles import _sum

MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)    # ggml's kvalues_mxfp4
BLOCK_BYTES = 17
_value = table_value(MXFP4_VALUES)


def e8m0_half(e):
    """ggml_e8m0_to_fp32_half(e) for an int32 scalar e in [0, 255]: 2^(e - 128) as float32, by its bits."""
    return tirx.reinterpret("float32", T.if_then_else(e < 2, T.shift_left(T.int32(0x00200000), e),
                                                      T.shift_left(e - 1, T.int32(23))))


def mxfp4_block_dot(vec: _Vectors, rows: int, group: int, m: int):
    """Block b of each row: acc += 2^(e - 128) * sum_i x_i * kvalues_mxfp4[q_i], the nibbles at byte 1 of the block
    (a table lookup each, as iq4_xs's), the scale from the e8m0 byte at byte 0. Blocks start at any byte (17 B), which
    the byte loads of `vec.bytes` do not mind."""
    lanes = vec.lanes

    def dot(x, w, row, b, tok):
        terms = []
        for vo in range(16 // lanes):       # lanes <= 16 on every tier
            q = vec.bytes(w, row, b * BLOCK_BYTES + 1 + vo * lanes)
            terms.append(x[tok, vec.at(b * 32 + vo * lanes)] * vec.lookup(q, _value))
            terms.append(x[tok, vec.at(b * 32 + 16 + vo * lanes)] * vec.lookup(vec.shr(q, 4), _value))
        return _sum(terms)

    def scale(w, row, b):
        return vec.bcast(e8m0_half(w[row, b * BLOCK_BYTES].astype("int32")))

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        for r in T.unroll(rows):
            for t in T.unroll(group):
                acc[t, r, vec.at(0)] = acc[t, r, vec.at(0)] + scale(w, T.min(first + r, n - 1), b) * dot(
                    x, w, T.min(first + r, n - 1), b, _token(p, t, group, m))

    return block_dot, None
