"""Block macros of the 32-weight quant formats (q8_0, q4_0) for gemv_quant.py's fp32-lane GEMVs.

AVX-512 (_scaled_dot): each row's block is dequantized to fp32 once (w = d * q, exact in fp32) and every token
FMAs it into two accumulators (acc, and accm as the second part). AVX2 and below keep the partial-sum form,
acc += d * (x . q): there one accumulator per token and row (16 registers) would chain 4 FMAs per block, and
that form measured 2x slower at m = 1 for q8_0 (2-core EPYC, AVX2 tier, one thread: 14.5 against 28 GB/s).
Either way every token's arithmetic is the same for every m (batch invariance).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.quant.tiles import _sum
from helmc.schedules.cpu.quant.vectors import _Vectors, _f32, _nibble_value, _token


def _q8_0(vec: _Vectors, rows: int, group: int, m: int):
    """Block b of each row: w_i = d * q_i, the 32 int8 quants at byte 2 of the block (exact in fp32: an 11-bit
    mantissa times an 8-bit integer), then acc += x_i * w_i (_scaled_dot)."""
    if vec.lanes != 16:
        return _partial_q8_0(vec, rows, group, m)
    lanes = vec.lanes

    def weights(w, wi, wh, row, b, d):
        return [d * _f32(wi[row, vec.at(b * 34 + 2 + vo * lanes)]) for vo in range(32 // lanes)]

    return _scaled_dot(vec, rows, group, m, lambda w, wh, row, b: vec.scale_lanes(wh, row, b * 17), weights), None


def _q4_0(vec: _Vectors, rows: int, group: int, m: int):
    """Block b of each row: w_i = d * (q_i - 8); byte i of the 16 at byte 2 holds weight i in its low nibble and
    weight i + 16 in its high one. The table holds d * (q - 8) (exact in fp32: an 11-bit mantissa times a 4-bit
    integer; on AVX-512 the constant table q - 8 times d, one multiply per block and row), so a lookup gives
    the weight; then acc += x_i * w_i (_scaled_dot)."""
    if vec.lanes != 16:
        return _partial_q4_0(vec, rows, group, m)

    def weights(w, wi, wh, row, b, q):
        value = lambda i: (_f32(i) + tirx.Broadcast(T.float32(-8), 16)) * vec.scale_lanes(wh, row, b * 9)
        return [vec.lookup(q, value), vec.lookup(vec.shr(q, 4), value)]

    # The widened bytes are bound once per row and block: read by both nibbles' lookups, they stay one vpmovzxbd
    # (+ vpsrld for the high nibbles); from two statements LLVM narrowed the high nibbles' shift to bytes (vpsrlw +
    # vpand + a second vpmovzxbd: q4_0 at m = 1 ran 12% slower).
    bind = lambda w, wh, row, b: vec.bytes(w, row, b * 18 + 2)
    return _scaled_dot(vec, rows, group, m, bind, weights), None


def scaled_dot_parts(vec: _Vectors) -> int:
    """Accumulators per token and row of the 32-weight formats (q8_0, q4_0): 2 on AVX-512 (_scaled_dot: one per
    vector of the block), else 1 (the partial-sum form)."""
    return 2 if vec.lanes == 16 else 1


def _scaled_dot(vec: _Vectors, rows: int, group: int, m: int, bind, weights):
    """block_dot of the 32-weight formats (q8_0, q4_0): each row's block is dequantized to fp32 weights once,
    weights(w, wi, wh, row, b, bound) its vectors in K order (bound: bind(w, wh, row, b), bound to a variable
    first), and every token of the pass multiplies them into its accumulators, one FMA per vector: vector
    vo into accumulator part vo % parts (scaled_dot_parts; part 1 is accm), in K order.
    The earlier form, acc += d * (x0 * q0 + x1 * q1), took 3 FP ops per token and block where this takes 2 (AVX-512),
    and two parts keep each accumulator's chain at one FMA per block (a chain of two ran slower than the old form
    at m = 8). The same per-token arithmetic for every m (batch invariance). Measured on the 2-core EPYC (Zen 5,
    one thread, 512 x 4096 from cache, interleaved runs): m = 8 q4_0 4.8 -> 5.5 GB/s, q8_0 9.1 -> 10.4; m = 1
    q4_0 unchanged (24.4), q8_0 46 -> 43 (one more multiply per block and row; the m = 1 GEMV is DRAM-bound
    on the GPU machine's Xeon)."""
    lanes, parts = vec.lanes, scaled_dot_parts(vec)
    vectors = 32 // lanes

    def part(acc, x, ws, t, r, b, p, k):
        return _fma_chain(acc[t, r, vec.at(0)], [x[_token(p, t, group, m), vec.at(b * 32 + vo * lanes)]
                                                        for vo in range(k, vectors, parts)], ws[k::parts])

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        for r in T.unroll(rows):
            bound = T.bind(bind(w, wh, T.min(first + r, n - 1), b))
            for t in T.unroll(group):
                acc[t, r, vec.at(0)] = part(acc, x, weights(w, wi, wh, T.min(first + r, n - 1), b, bound), t, r, b, p, 0)
                if parts == 2:   # the second part in accm (_second_lanes)
                    accm[t, r, vec.at(0)] = part(accm, x, weights(w, wi, wh, T.min(first + r, n - 1), b, bound),
                                                 t, r, b, p, 1)

    return block_dot


def _fma_chain(acc, xs, ws):
    """((acc + xs[0] * ws[0]) + xs[1] * ws[1]) + ...: one expression per accumulator."""
    for xv, wv in zip(xs, ws):
        acc = acc + xv * wv
    return acc


def _partial_q8_0(vec: _Vectors, rows: int, group: int, m: int):
    """AVX2 and below: block b of each row, acc += d * sum_i x_i * q_i, the 32 int8 quants at byte 2 of the block."""
    lanes = vec.lanes

    def dot(x, wi, row, b, tok):
        return _sum([x[tok, vec.at(b * 32 + vo * lanes)] * _f32(wi[row, vec.at(b * 34 + 2 + vo * lanes)])
                     for vo in range(32 // lanes)])

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        for r in T.unroll(rows):
            for t in T.unroll(group):
                acc[t, r, vec.at(0)] = acc[t, r, vec.at(0)] + vec.scale(wh, T.min(first + r, n - 1), b * 17) * dot(
                    x, wi, T.min(first + r, n - 1), b, _token(p, t, group, m))

    return block_dot, None


def _partial_q4_0(vec: _Vectors, rows: int, group: int, m: int):
    """AVX2 and below: block b of each row, acc += d * sum_i x_i * (q_i - 8); byte i of the 16 at byte 2 holds
    weight i in its low nibble and weight i + 16 in its high one. The table holds q - 8."""
    lanes = vec.lanes
    value = _nibble_value(-8.0)

    def dot(x, w, row, b, tok):
        terms = []
        for vo in range(16 // lanes):
            q = vec.bytes(w, row, b * 18 + 2 + vo * lanes)
            terms.append(x[tok, vec.at(b * 32 + vo * lanes)] * vec.lookup(q, value))
            terms.append(x[tok, vec.at(b * 32 + 16 + vo * lanes)] * vec.lookup(vec.shr(q, 4), value))
        return _sum(terms)

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        for r in T.unroll(rows):
            for t in T.unroll(group):
                acc[t, r, vec.at(0)] = acc[t, r, vec.at(0)] + vec.scale(wh, T.min(first + r, n - 1), b * 9) * dot(
                    x, w, T.min(first + r, n - 1), b, _token(p, t, group, m))

    return block_dot, None
