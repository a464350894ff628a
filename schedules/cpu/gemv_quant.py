"""Decode GEMV over llama.cpp's quantized block formats: y[n] = W[n, k] @ x[k], W as its raw GGUF bytes.

W is a uint8 buffer [n, k / block_weights * block_bytes]: each row is its blocks along k, laid out exactly as
ggml's block structs (ggml-common.h), so a GGUF tensor is passed as mapped, never repacked or widened:
    q8_0 (34 B / 32 w):   d fp16, 32 x int8                                  w = d * q
    q4_0 (18 B / 32 w):   d fp16, 16 B nibbles (w[i] low, w[i+16] high)     w = d * (q - 8)
    q4_k (144 B / 256 w): d, dmin fp16, 12 B of 6-bit (scale, min) for 8 sub-blocks of 32, 128 B nibbles
                          (32-byte chunk c: low nibbles are sub-block 2c, high ones 2c+1)
                          w = d * sc_j * q - dmin * m_j
    q6_k (210 B / 256 w): 128 B low nibbles, 64 B high 2-bit pairs, 16 x int8 scales (sub-blocks of 16), d fp16
                          w = d * sc_j * (q - 32)

Why this loop (the decode step is only worth running on the CPU at the DRAM ceiling, and a quantized weight
is 2-4x fewer bytes than fp16, so the decode arithmetic per byte is 2-4x higher than gemv.py's):
- parallel over groups of QUANT_ROWS rows, each row one contiguous stream of blocks (as gemv.py);
- the quants of one (sub-)block are widened to fp32 in registers and multiplied by x into a block-local
  partial sum, vectorised over the sub-block's weights; the block's scale (fp16, converted the way fp16
  weights are: weight_load.widen) is applied once per (sub-)block with one FMA into the row's accumulator,
  so the inner loop is widen + FMA per vector, and no per-element scale multiply;
- the constant offsets (q4_0's -8, q6_k's -32) are subtracted in int8 before widening (one byte op per 16
  or 32 weights); q4_k's per-sub-block min is applied as dmin * m_j * sum(x over the sub-block), that sum
  computed once per block for all rows of the group;
- every fp16 field sits at an even byte offset of the row (all block sizes are even), so the scales are read
  through a float16 view of the same buffer and the int8 quants through an int8 view;
- each block step software-prefetches PREFETCH_BYTES ahead in every row (one prefetch per 64-byte line of a
  block), running into the next group's rows past the row end, as gemv.prefetch_ahead does.
Accumulation is fp32 throughout; results differ from a float64 reference by fp32 rounding only (~1e-6).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK, widen


@dataclass(frozen=True)
class QuantBlock:
    weights: int     # weights per block (along k)
    bytes: int       # bytes per block


QUANT_BLOCKS = {"q8_0": QuantBlock(32, 34), "q4_0": QuantBlock(32, 18),
                "q4_k": QuantBlock(256, 144), "q6_k": QuantBlock(256, 210)}

# Rows per parallel step: 4 independent DRAM streams and accumulator chains per thread, as gemv.gemv_blocking
# chose for m = 1 (its measurement: 4 rows ran 15-17 GB/s where 1 row ran 11-13 GB/s on the 2-core EPYC).
QUANT_ROWS = 4
# Software prefetch distance in bytes of each row (0: none). gemv.py's 16 steps are 512 B (AVX2) to 1 KiB
# (AVX-512) of fp16 ahead; a quantized row is the same stream of bytes, so the same distance in bytes.
PREFETCH_BYTES = 1024
_LINE = 64


def quant_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights in `qtype`, after checking that k is whole blocks."""
    fmt = _check(qtype, 1, k)
    return k // fmt.weights * fmt.bytes


def _check(qtype: str, n: int, k: int) -> QuantBlock:
    from helmc.errors import HelmcError
    if qtype not in QUANT_BLOCKS:
        raise HelmcError(f"quantized GEMV: weight type expected one of {tuple(QUANT_BLOCKS)}, found {qtype!r}")
    fmt = QUANT_BLOCKS[qtype]
    if k < 1 or k % fmt.weights:
        raise HelmcError(f"quantized GEMV: {qtype} k expected a positive multiple of its {fmt.weights}-weight "
                         f"block, found k={k}")
    if n < 1:
        raise HelmcError(f"quantized GEMV: n expected >= 1, found n={n}")
    return fmt


def make_gemv_quant(qtype: str, n: int, k: int, isa: VectorIsa, prefetch_bytes: int | None = None) -> tirx.PrimFunc:
    """PrimFunc(x: float32[k], w: uint8[n, row_bytes], y: float32[n]) with y = dequant(w) @ x.

    qtype: "q8_0" | "q4_0" | "q4_k" | "q6_k"; k must be a multiple of the type's block (HelmcError otherwise).
    prefetch_bytes overrides PREFETCH_BYTES (benchmarks).
    """
    fmt = _check(qtype, n, k)
    rows, lanes = QUANT_ROWS, isa.fp32_lanes
    blocks = k // fmt.weights
    row_bytes = blocks * fmt.bytes
    steps = -(-n // rows)          # the last step clamps its row index for loads and skips its stores
    block_dot = _BLOCK_DOT[qtype](rows, lanes, not isa.is_slow_fallback)
    prefetch = _prefetch(rows, fmt.bytes, row_bytes, PREFETCH_BYTES if prefetch_bytes is None else prefetch_bytes)

    @T.prim_func
    def gemv(x: T.Buffer((k,), "float32"), w: T.Buffer((n, row_bytes), "uint8"), y: T.Buffer((n,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wi = T.decl_buffer((n, row_bytes), "int8", data=w.data)
        wh = T.decl_buffer((n, row_bytes // 2), "float16", data=w.data)   # [n, row_bytes / 2]: fp16 fields
        for step in T.parallel(steps):
            acc = T.alloc_buffer((rows, lanes), "float32", scope="global", annotations=STACK)
            for r in T.unroll(rows):
                for v in T.vectorized(lanes):
                    acc[r, v] = T.float32(0)
            for b in T.serial(blocks):
                prefetch(w, n, step * rows, b)
                block_dot(x, w, wi, wh, acc, n, step * rows, b)
            for r in T.unroll(rows):
                if step * rows + r < n:
                    total = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
                    total[0] = T.float32(0)
                    for v in T.unroll(lanes):
                        total[0] = total[0] + acc[r, v]
                    y[step * rows + r] = total[0]

    return gemv.with_attr("global_symbol", f"helmc_gemv_{qtype}_n{n}_k{k}")


def _prefetch(rows: int, block_bytes: int, row_bytes: int, ahead: int):
    """Macro prefetch(w, n, first, b): the lines of block b's bytes `ahead` further along each row, or past the
    row end that offset of the next group's row (clamped to row n - 1), so DRAM requests keep running across
    4 KiB page ends where the hardware prefetchers stop. Nothing when ahead is 0."""
    lines = -(-block_bytes // _LINE)     # gaps between consecutive prefetched addresses stay <= one line

    @T.macro
    def prefetch(w, n, first, b):
        if ahead > 0:
            for r in T.unroll(rows):
                for line in T.unroll(lines):
                    T.evaluate(T.call_llvm_intrin(
                        "void", "llvm.prefetch", T.address_of(w[
                            T.min(T.if_then_else(b * block_bytes + line * _LINE + ahead < row_bytes,
                                                 first + r, first + rows + r), n - 1),
                            T.if_then_else(b * block_bytes + line * _LINE + ahead < row_bytes,
                                           b * block_bytes + line * _LINE + ahead,
                                           T.min(b * block_bytes + line * _LINE + ahead - row_bytes, row_bytes - 1))]),
                        T.int32(0), T.int32(3), T.int32(1)))

    return prefetch


def _f32(v):
    return tirx.Cast("float32", v)


def _q8_0(rows: int, lanes: int, f16c: bool):
    """Block b of each row: acc += d * sum_i x_i * q_i, the 32 int8 quants at byte 2 of the block."""
    vecs = 32 // lanes

    @T.macro
    def block_dot(x, w, wi, wh, acc, n, first, b):
        for r in T.unroll(rows):
            part = T.alloc_buffer((lanes,), "float32", scope="global", annotations=STACK)
            for v in T.vectorized(lanes):
                part[v] = T.float32(0)
            for vo in T.unroll(vecs):
                for v in T.vectorized(lanes):
                    part[v] = part[v] + x[b * 32 + vo * lanes + v] * _f32(
                        wi[T.min(first + r, n - 1), b * 34 + 2 + vo * lanes + v])
            d = widen(wh[T.min(first + r, n - 1), b * 17], "float16", f16c)
            for v in T.vectorized(lanes):
                acc[r, v] = acc[r, v] + d * part[v]

    return block_dot


def _q4_0(rows: int, lanes: int, f16c: bool):
    """Block b of each row: acc += d * sum_i x_i * (q_i - 8); byte i of the 16 at byte 2 holds weight i in its
    low nibble and weight i + 16 in its high one. The -8 is applied to the nibble as an int8."""
    vecs = 16 // lanes if lanes <= 16 else 1
    width = min(lanes, 16)

    @T.macro
    def block_dot(x, w, wi, wh, acc, n, first, b):
        for r in T.unroll(rows):
            part = T.alloc_buffer((width,), "float32", scope="global", annotations=STACK)
            for v in T.vectorized(width):
                part[v] = T.float32(0)
            for half in T.unroll(2):
                for vo in T.unroll(vecs):
                    for v in T.vectorized(width):
                        part[v] = part[v] + x[b * 32 + half * 16 + vo * width + v] * _f32(
                            tirx.Cast("int8", T.bitwise_and(T.shift_right(
                                w[T.min(first + r, n - 1), b * 18 + 2 + vo * width + v],
                                tirx.Cast("uint8", half * 4)), T.uint8(15))) - T.int8(8))
            d = widen(wh[T.min(first + r, n - 1), b * 9], "float16", f16c)
            for v in T.vectorized(width):
                acc[r, v] = acc[r, v] + d * part[v]

    return block_dot


def _q4_k_scale_min(w, row, base, j):
    """(scale, min) 6-bit values of sub-block j from the 12 packed bytes at w[row, base..]: j < 4 keep their
    low 6 bits in bytes j (scale) and j + 4 (min); j >= 4 have their low 4 bits in byte j + 4 (scale low
    nibble, min high nibble) and their top 2 bits in the top bits of bytes j - 4 (scale) and j (min)."""
    u8 = lambda v: T.uint8(v)
    scale = T.if_then_else(
        j < 4, T.bitwise_and(w[row, base + j], u8(63)),
        T.bitwise_or(T.bitwise_and(w[row, base + j + 4], u8(15)),
                     T.shift_left(T.shift_right(w[row, base + j - 4], u8(6)), u8(4))))
    minimum = T.if_then_else(
        j < 4, T.bitwise_and(w[row, base + j + 4], u8(63)),
        T.bitwise_or(T.shift_right(w[row, base + j + 4], u8(4)),
                     T.shift_left(T.shift_right(w[row, base + j], u8(6)), u8(4))))
    return _f32(scale), _f32(minimum)


def _q4_k(rows: int, lanes: int, f16c: bool):
    """Block b: for each sub-block j of 32, acc += d * sc_j * sum x*q - dmin * m_j * sum x. sum x over the
    sub-block (xs) is the same for every row, so it is summed once per group of rows."""
    vecs = 32 // lanes

    @T.macro
    def block_dot(x, w, wi, wh, acc, n, first, b):
        for c in T.unroll(4):
            for half in T.unroll(2):
                xs = T.alloc_buffer((lanes,), "float32", scope="global", annotations=STACK)
                for v in T.vectorized(lanes):
                    xs[v] = T.float32(0)
                for vo in T.unroll(vecs):
                    for v in T.vectorized(lanes):
                        xs[v] = xs[v] + x[b * 256 + (c * 2 + half) * 32 + vo * lanes + v]
                for r in T.unroll(rows):
                    part = T.alloc_buffer((lanes,), "float32", scope="global", annotations=STACK)
                    for v in T.vectorized(lanes):
                        part[v] = T.float32(0)
                    for vo in T.unroll(vecs):
                        for v in T.vectorized(lanes):
                            part[v] = part[v] + x[b * 256 + (c * 2 + half) * 32 + vo * lanes + v] * _f32(
                                T.bitwise_and(T.shift_right(
                                    w[T.min(first + r, n - 1), b * 144 + 16 + c * 32 + vo * lanes + v],
                                    tirx.Cast("uint8", half * 4)), T.uint8(15)))
                    sc, mn = _q4_k_scale_min(w, T.min(first + r, n - 1), b * 144 + 4, c * 2 + half)
                    scale = widen(wh[T.min(first + r, n - 1), b * 72], "float16", f16c) * sc
                    offset = widen(wh[T.min(first + r, n - 1), b * 72 + 1], "float16", f16c) * mn
                    for v in T.vectorized(lanes):
                        acc[r, v] = acc[r, v] + scale * part[v] - offset * xs[v]

    return block_dot


def _q6_k(rows: int, lanes: int, f16c: bool):
    """Block b: weight 128h + 32c + l (half h, quarter c, l < 32) is q = ql | qh << 4 - 32 with ql the nibble
    4*(c // 2) of byte 64h + 32(c % 2) + l and qh bits 2c..2c+1 of byte 128 + 32h + l; sub-block j = (weight
    // 16) has the int8 scale at byte 192 + j, d (fp16) is at byte 208. acc += d * sc_j * sum x*q per j."""
    width = min(lanes, 16)
    vecs = 16 // width

    @T.macro
    def block_dot(x, w, wi, wh, acc, n, first, b):
        for h in T.unroll(2):
            for c in T.unroll(4):
                for s in T.unroll(2):
                    for r in T.unroll(rows):
                        part = T.alloc_buffer((width,), "float32", scope="global", annotations=STACK)
                        for v in T.vectorized(width):
                            part[v] = T.float32(0)
                        for vo in T.unroll(vecs):
                            for v in T.vectorized(width):
                                part[v] = part[v] + x[b * 256 + h * 128 + c * 32 + s * 16 + vo * width + v] * _f32(
                                    tirx.Cast("int8", T.bitwise_or(
                                        T.bitwise_and(T.shift_right(
                                            w[T.min(first + r, n - 1),
                                              b * 210 + h * 64 + (c % 2) * 32 + s * 16 + vo * width + v],
                                            tirx.Cast("uint8", (c // 2) * 4)), T.uint8(15)),
                                        T.shift_left(T.bitwise_and(T.shift_right(
                                            w[T.min(first + r, n - 1), b * 210 + 128 + h * 32 + s * 16 + vo * width + v],
                                            tirx.Cast("uint8", c * 2)), T.uint8(3)), T.uint8(4)))) - T.int8(32))
                        scale = widen(wh[T.min(first + r, n - 1), b * 105 + 104], "float16", f16c) * _f32(
                            wi[T.min(first + r, n - 1), b * 210 + 192 + h * 8 + c * 2 + s])
                        for v in T.vectorized(width):
                            acc[r, v] = acc[r, v] + scale * part[v]

    return block_dot


_BLOCK_DOT = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q6_k": _q6_k}
