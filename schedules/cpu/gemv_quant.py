"""Decode GEMV over llama.cpp's quantized block formats: y[n] = W[n, k] @ x[k], W as its raw GGUF bytes.

W is a uint8 buffer [n, k / block_weights * block_bytes]: each row is its blocks along k, laid out exactly as
ggml's block structs (ggml-common.h), so a GGUF tensor is passed as mapped, never repacked or widened:
    q8_0 (34 B / 32 w):   d fp16, 32 x int8                                  w = d * q
    q4_0 (18 B / 32 w):   d fp16, 16 B nibbles (w[i] low, w[i+16] high)     w = d * (q - 8)
    q5_0 (22 B / 32 w):   d fp16, qh[4] (bit i: bit 4 of weight i), 16 B nibbles as q4_0's   w = d * (q - 16)
    q3_k (110 B / 256 w): hmask[32], qs[64] 2-bit, 12 B of 6-bit scales for 16 sub-blocks of 16, d fp16
                          w = d * (sc_j - 32) * (q - 4)
    q4_k (144 B / 256 w): d, dmin fp16, 12 B of 6-bit (scale, min) for 8 sub-blocks of 32, 128 B nibbles
                          (32-byte chunk c: low nibbles are sub-block 2c, high ones 2c+1)
                          w = d * sc_j * q - dmin * m_j
    q5_k (176 B / 256 w): q4_k's 16-byte header, qh[32] (bit j of byte l: bit 4 of weight l of sub-block j),
                          128 B nibbles as q4_k's;  w = d * sc_j * q - dmin * m_j, q in [0, 31]
    q6_k (210 B / 256 w): 128 B low nibbles, 64 B high 2-bit pairs, 16 x int8 scales (sub-blocks of 16), d fp16
                          w = d * sc_j * (q - 32)
    iq4_xs (136 B / 256 w): d fp16, scales_h u16, scales_l[4] (6-bit scales of 8 sub-blocks of 32), 128 B nibbles
                          (sub-block j: bytes 16j.., as q4_0's)   w = d * (ls_j - 32) * kvalues[q]
    mxfp4 (17 B / 32 w):  e8m0 byte, 16 B nibbles as q4_0's   w = kvalues_mxfp4[q] * 2^(e - 128) (quant/mxfp4.py)

Why this loop: a quantized weight is 2-4x fewer bytes than fp16, so the decode arithmetic per byte is 2-4x
gemv.py's, and on the GPU machine's Xeon (16 cores, 2.4 GHz) the first, plainly widening version of these
kernels was bound by the vector ports, not DRAM: one core decoded q4_0 at 6.6 cycles per 32 weights, and 16
cores reached 45 GB/s (q4_0), 37 (q4_k), 49 (q6_k) where the fp16 GEMV reads 107. Every step is therefore
made cheap:
- parallel over groups of `rows` rows, each row one contiguous stream of blocks (as gemv.py);
- each vector of quants becomes fp32 in registers and is multiplied by x into a (sub-)block-local partial
  sum; the (sub-)block's scale is applied once, as one FMA into the row's accumulator;
- 4-bit fields become floats by a 16-entry table lookup: on AVX-512 one vpermps per 16 weights, which reads
  only the low 4 bits of each index lane, so a nibble needs no mask and no convert, and the table holds the
  offset too (q4_0's q - 8, q6_k's high bits * 16 - 32; iq4_xs's and mxfp4's non-linear values); AVX2 and SSE2 mask
  and convert;
- the K-quants read their quant bytes as int32 words (one plain vector load; byte j of each word is picked by
  a shift in 32-bit lanes, where widening bytes would cost a shuffle each), so the lanes hold weights in a
  strided order; x is permuted once per call to match (xp), and sub-block scales reach their lanes by one
  permute per vector of partial sums;
- q4_k's mins: sum_j dmin * m_j * sum(x over sub-block j) is one 8-lane FMA per block and row against
  per-sub-block sums of x (xsum), formed once per call before the parallel loop;
- every fp16 field sits at an even byte offset of the row (the sizes of the blocks that have one are even), so
  scales are read through a float16 view of the same buffer (converted as fp16 weights are: weight_load.widen),
  int8 quants through an int8 view; mxfp4's odd 17-byte blocks have a one-byte power-of-two scale instead;
- software prefetch `prefetch_bytes` ahead in every row, one per 64-byte line, past the row end into the same
  row of the next group (the rows a thread reads next: its parallel steps are contiguous).
- m tokens (a batched decode step): x is [m, k], y [m, n]; each block's quants are decoded once per
  row and multiplied into every token's accumulators, so the decode work is shared by the batch. Token t's
  sums are formed the same way for every m (the same lanes, block order, scale FMAs and lane sums), so its
  y[t] is bit-identical to the m = 1 kernel's on that token alone; m only changes rows per step and how many
  tokens one pass over K carries (quant_blocking).
Accumulation is fp32 throughout; results differ from a float64 reference by fp32 rounding only (~1e-7).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.model.spec import QUANT_BLOCKS as MODEL_QUANT_BLOCKS, check_quant_shape
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.float_lanes import (_f32, _ints, _lane_index, _lanes, _nibble_value, _token, _Vectors,
                                                   table_value)
from helmc.schedules.cpu.quant.mxfp4 import mxfp4_block_dot
from helmc.schedules.cpu.quant.prefetch import prefetch_macro as _prefetch
from helmc.schedules.cpu.quant.tiles import QuantTiles, _hsum, _sum
from helmc.schedules.cpu.weight_load import STACK, widen


@dataclass(frozen=True)
class QuantBlock:
    weights: int     # weights per block (along k)
    bytes: int       # bytes per block


QUANT_BLOCKS = {name: QuantBlock(*size) for name, size in MODEL_QUANT_BLOCKS.items()}   # one table: model.spec



@dataclass(frozen=True)
class QuantGemvTuning:
    # Rows per parallel step: independent DRAM streams and accumulator chains per thread; 4 as
    # gemv.gemv_blocking chose for m = 1 (4 rows ran 15-17 GB/s where 1 row ran 11-13 GB/s on the 2-core EPYC).
    rows: int = 4
    # Software prefetch distance along each row in bytes (0: none).
    prefetch_bytes: int = 2048
    # llvm.prefetch locality: 3 = prefetcht0 (into L1), 2 = t1 (L2), 1 = t2.
    prefetch_locality: int = 3

    def __post_init__(self):
        assert self.rows >= 1 and self.prefetch_bytes >= 0 and self.prefetch_locality in (1, 2, 3), self


DEFAULT_TUNING = QuantGemvTuning()
WITH_MINS = ("q4_k", "q5_k")        # the affine K-quants: w = d * sc_j * q - dmin * m_j


def quant_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights in `qtype`, after checking that k is whole blocks."""
    fmt = _check(qtype, 1, k)
    return k // fmt.weights * fmt.bytes


def _check(qtype: str, n: int, k: int) -> QuantBlock:
    return QuantBlock(*check_quant_shape(qtype, n, k, "quantized GEMV"))


def quant_blocking(qtype: str, m: int, isa: VectorIsa, tuning: QuantGemvTuning = DEFAULT_TUNING) -> tuple[int, int]:
    """(weight rows per step, tokens per pass over K). One token: tuning.rows. More: fewer rows, so the
    group x rows accumulators (two per token and row for q4_k's mins) fit in half the vector registers and
    every token rides one pass (a second pass would decode the quants again)."""
    if m == 1:
        return tuning.rows, 1
    per_token = 2 if qtype in WITH_MINS else 1
    rows = max(1, tuning.rows // m)
    group = max(1, min(m, isa.vector_registers // 2 // (rows * per_token)))
    return rows, -(-m // -(-m // group))       # tokens split evenly over the passes


def gemv_quant_symbol(qtype: str, n: int, k: int, m: int = 1) -> str:
    return f"helmc_gemv_{qtype}_n{n}_k{k}" if m == 1 else f"helmc_gemv_{qtype}_m{m}_n{n}_k{k}"


def make_gemv_quant_float(qtype: str, n: int, k: int, isa: VectorIsa,
                          tuning: QuantGemvTuning = DEFAULT_TUNING, m: int = 1) -> tirx.PrimFunc:
    """PrimFunc(x: float32[m, k], w: uint8[n, row_bytes], y: float32[m, n]) with y = x @ dequant(w)^T, every
    weight widened to fp32 in registers (what quant/decode_gemv.make_gemv_quant picks where integer dot products
    are not used).

    qtype: "q8_0" | "q4_0" | "q5_0" | "q3_k" | "q4_k" | "q5_k" | "q6_k" | "iq4_xs" | "mxfp4"; k must be a multiple of
    the type's block (HelmcError otherwise).
    Row t of y is bit-identical to what the kernel for m = 1 computes from x[t] alone.
    """
    fmt = _check(qtype, n, k)
    assert m >= 1, m
    if m > 1:
        return _make_float_tiled(qtype, n, k, isa, tuning, m).with_attr("global_symbol",
                                                                         gemv_quant_symbol(qtype, n, k, m))
    vec = _Vectors(isa)
    rows, group = quant_blocking(qtype, m, isa, tuning)
    lanes = vec.lanes
    passes = -(-m // group)
    blocks = k // fmt.weights
    row_bytes = blocks * fmt.bytes
    steps = -(-n // rows)          # the last step clamps its row index for loads and skips its stores
    block_dot, order = _BLOCK_DOT[qtype](vec, rows, group, m)
    prefetch = _prefetch(rows, fmt.bytes, row_bytes, tuning, n)
    mins = qtype in WITH_MINS
    subs = k // 32 if mins else 1  # sub-blocks of 32 whose x sums q4_k's mins need
    permuted = order is not None   # the K-quants read x in the lane order of their quant words (xp)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, row_bytes), "uint8"), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wi = T.decl_buffer((n, row_bytes), "int8", data=w.data)
        wh = T.decl_buffer((n, row_bytes // 2), "float16", data=w.data)   # [n, row_bytes / 2]: fp16 fields
        wf = T.decl_buffer((n * row_bytes,), "uint8", data=w.data)        # [n * row_bytes]: prefetch addresses
        xsum = T.alloc_buffer((m, subs), "float32")
        xp = T.alloc_buffer((m, k if permuted else 1), "float32")
        for t in T.serial(m):
            if mins:
                for j in T.serial(subs):
                    xsum[t, j] = _hsum(_sum([x[t, vec.at(j * 32 + vo * lanes)] for vo in range(32 // lanes)]))
            if permuted:
                for b in T.serial(blocks):
                    for g in T.serial(256 // lanes):
                        for i in T.vectorized(lanes):
                            xp[t, b * 256 + g * lanes + i] = x[t, b * 256 + order(g, i)]
        for step in T.parallel(steps):
            for p in T.serial(passes):
                acc = T.alloc_buffer((group, rows, lanes), "float32", scope="global", annotations=STACK)
                accm = T.alloc_buffer((group, rows, 8), "float32", scope="global", annotations=STACK)   # q4_k mins
                for t in T.unroll(group):
                    for r in T.unroll(rows):
                        acc[t, r, vec.at(0)] = vec.bcast(T.float32(0))
                        accm[t, r, vec.at(0, 8)] = vec.bcast(T.float32(0), 8)
                for b in T.serial(blocks):
                    prefetch(wf, step * rows, b)
                    block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, step * rows, b, p)
                for t in T.unroll(group):
                    for r in T.unroll(rows):
                        if step * rows + r < n and p * group + t < m:
                            if mins:
                                y[p * group + t, step * rows + r] = _hsum(acc[t, r, vec.at(0)]) - _hsum(
                                    accm[t, r, vec.at(0, 8)])
                            else:
                                y[p * group + t, step * rows + r] = _hsum(acc[t, r, vec.at(0)])

    return gemv.with_attr("global_symbol", gemv_quant_symbol(qtype, n, k, m))


def float_tiles(qtype: str, m: int, k: int, isa: VectorIsa, tuning: QuantGemvTuning = DEFAULT_TUNING) -> QuantTiles:
    """The m > 1 loop of make_gemv_quant_float: x read per block and token is the block's fp32 values."""
    weights = QUANT_BLOCKS[qtype].weights
    return QuantTiles.make(*quant_blocking(qtype, m, isa, tuning), m, k // weights, weights * 4, _Vectors(isa).lanes)


def _make_float_tiled(qtype: str, n: int, k: int, isa: VectorIsa, tuning: QuantGemvTuning, m: int):
    """make_gemv_quant_float for m > 1 in quant/tiles.QuantTiles' order: the same block_dot per (row group, block,
    pass), the same prologue (xsum, xp), the accumulators kept between K tiles."""
    fmt, vec = _check(qtype, n, k), _Vectors(isa)
    lanes, blocks = vec.lanes, k // fmt.weights
    row_bytes = blocks * fmt.bytes
    qt = float_tiles(qtype, m, k, isa, tuning)
    rows, group, rb, tile = qt.rows, qt.group, qt.block_rows, qt.tile_blocks
    passes, tiles = qt.passes(m), -(-blocks // qt.tile_blocks)
    block_dot, order = _BLOCK_DOT[qtype](vec, rows, group, m)
    prefetch = _prefetch(rows, fmt.bytes, row_bytes, tuning, n, ahead=tile * fmt.bytes, wrap_rows=rb)
    mins = qtype in WITH_MINS
    zero, load, save, finish = qt.macros(m, mins)
    subs = k // 32 if mins else 1
    permuted = order is not None

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, row_bytes), "uint8"), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wi = T.decl_buffer((n, row_bytes), "int8", data=w.data)
        wh = T.decl_buffer((n, row_bytes // 2), "float16", data=w.data)
        wf = T.decl_buffer((n * row_bytes,), "uint8", data=w.data)
        xsum = T.alloc_buffer((m, subs), "float32")
        xp = T.alloc_buffer((m, k if permuted else 1), "float32")
        for t in T.serial(m):
            if mins:
                for j in T.serial(subs):
                    xsum[t, j] = _hsum(_sum([x[t, vec.at(j * 32 + vo * lanes)] for vo in range(32 // lanes)]))
            if permuted:
                for b in T.serial(blocks):
                    for g in T.serial(256 // lanes):
                        for i in T.vectorized(lanes):
                            xp[t, b * 256 + g * lanes + i] = x[t, b * 256 + order(g, i)]
        for step in T.parallel(-(-n // rb)):
            accs = T.alloc_buffer((rb, passes * group, lanes), "float32", scope="global", annotations=STACK)
            accms = T.alloc_buffer((rb, passes * group, 8), "float32", scope="global", annotations=STACK)
            zero(accs, accms)
            for kt in T.serial(tiles):
                for rg in T.serial(T.min(rb // rows, (n - step * rb + rows - 1) // rows)):
                    for p in T.serial(passes):
                        acc = T.alloc_buffer((group, rows, lanes), "float32", scope="global", annotations=STACK)
                        accm = T.alloc_buffer((group, rows, 8), "float32", scope="global", annotations=STACK)
                        load(accs, accms, acc, accm, rg, p)
                        for bi in T.serial(T.min(tile, blocks - kt * tile)):
                            prefetch(wf, step * rb + rg * rows, kt * tile + bi)
                            block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, step * rb + rg * rows, kt * tile + bi, p)
                        save(accs, accms, acc, accm, rg, p)
            finish(accs, accms, y, n, step * rb)

    return gemv


def _q8_0(vec: _Vectors, rows: int, group: int, m: int):
    """Block b of each row: acc += d * sum_i x_i * q_i, the 32 int8 quants at byte 2 of the block."""
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


def _q4_0(vec: _Vectors, rows: int, group: int, m: int):
    """Block b of each row: acc += d * sum_i x_i * (q_i - 8); byte i of the 16 at byte 2 holds weight i in its
    low nibble and weight i + 16 in its high one. The table holds q - 8."""
    lanes = vec.lanes
    value = _nibble_value(-8.0)

    def dot(x, w, row, b, tok):
        terms = []
        for vo in range(16 // lanes):       # lanes <= 16 on every tier
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


def _q5_0(vec: _Vectors, rows: int, group: int, m: int):
    """q4_0's loop over q5_0's blocks (22 B: d, qh[4] at byte 2, the nibbles at 6): weight i's nibble gains 16 * bit
    i of the little-endian qh word; acc += d * sum_i x_i * (q_i - 16). Both parts are table lookups (the nibble's
    table holds q - 16, the fifth bit's 16 * bit), added as fp32."""
    lanes = vec.lanes
    value = _nibble_value(-16.0)
    ramp = tirx.Ramp(tirx.const(0, "int32"), 1, lanes)

    def high(i):
        return _f32(tirx.bitwise_and(i, _ints(1, i))) * tirx.Broadcast(tirx.const(16.0, "float32"), _lanes(i))

    def fifth(qh, first):
        """The qh word shifted per lane so that weight first + i's fifth bit is bit 0 of lane i."""
        return tirx.shift_right(vec.bcast(qh), ramp + _ints(first, ramp))

    def dot(x, w, row, b, tok):
        qh = w[row, b * 22 + 2].astype("int32")      # 4 byte loads: a block is only 2-byte aligned
        for i in range(1, 4):
            qh = qh | (w[row, b * 22 + 2 + i].astype("int32") << (8 * i))
        terms = []
        for vo in range(16 // lanes):       # lanes <= 16 on every tier
            q = vec.bytes(w, row, b * 22 + 6 + vo * lanes)
            for half, nib in ((0, q), (16, vec.shr(q, 4))):
                first = half + vo * lanes
                terms.append(x[tok, vec.at(b * 32 + first)] * (vec.lookup(nib, value)
                                                              + vec.lookup(fifth(qh, first), high)))
        return _sum(terms)

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        for r in T.unroll(rows):
            for t in T.unroll(group):
                acc[t, r, vec.at(0)] = acc[t, r, vec.at(0)] + vec.scale(wh, T.min(first + r, n - 1), b * 11) * dot(
                    x, w, T.min(first + r, n - 1), b, _token(p, t, group, m))

    return block_dot, None


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)   # ggml's kvalues_iq4nl


_iq4_value = table_value(IQ4_VALUES)


def _iq4_xs(vec: _Vectors, rows: int, group: int, m: int):
    """Block b of each row (136 B: d, scales_h at byte 2, scales_l at 4, the nibbles at 8): sub-block j of 32 is
    q4_0's nibble layout at byte 8 + 16j, its values IQ4_VALUES[q] (a table lookup), its scale d * (ls_j - 32) with
    ls_j = nibble j % 2 of scales_l[j // 2] | bits 2j of scales_h << 4; acc += scale_j * sum_i x_i * value_i."""
    lanes = vec.lanes

    def dot(x, w, row, b, j, tok):
        terms = []
        for vo in range(16 // lanes):       # lanes <= 16 on every tier
            q = vec.bytes(w, row, b * 136 + 8 + 16 * j + vo * lanes)
            terms.append(x[tok, vec.at(b * 256 + 32 * j + vo * lanes)] * vec.lookup(q, _iq4_value))
            terms.append(x[tok, vec.at(b * 256 + 32 * j + 16 + vo * lanes)] * vec.lookup(vec.shr(q, 4), _iq4_value))
        return _sum(terms)

    def scale(w, wh, row, b, j):
        low = (w[row, b * 136 + 4 + j // 2].astype("int32") >> (4 * (j % 2))) & 15
        high = (w[row, b * 136 + 2 + j // 4].astype("int32") >> (2 * (j % 4))) & 3
        return vec.bcast(widen(wh[row, b * 68], "float16", vec.f16c) * _f32((low | (high << 4)) - 32))

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        for r in T.unroll(rows):
            for j in T.unroll(8):
                for t in T.unroll(group):
                    acc[t, r, vec.at(0)] = acc[t, r, vec.at(0)] + scale(w, wh, T.min(first + r, n - 1), b, j) * dot(
                        x, w, T.min(first + r, n - 1), b, j, _token(p, t, group, m))

    return block_dot, None


def _q4_k(vec: _Vectors, rows: int, group: int, m: int):
    return _affine_k(vec, rows, group, m, fifth_bit=False)


def _q5_k(vec: _Vectors, rows: int, group: int, m: int):
    """q4_k's loop over q5_k's blocks (176 B: the same header, qh[32] at byte 16, the nibbles at 48): each
    weight's nibble gains 16 * its fifth bit, bit 2c + t of qh byte p % 32 for the lane's byte p (chunk
    c = p // 32, nibble t), read as int32 words like q6_k's high bits."""
    return _affine_k(vec, rows, group, m, fifth_bit=True)


def _affine_k(vec: _Vectors, rows: int, group: int, m: int, fifth_bit: bool):
    """Block b: for each sub-block j of 32, acc += d * sc_j * sum x*q, and accm += dmin * m_j * sum x (the
    kernel subtracts accm at the end). The 12 scale bytes s[0..12) hold, for i < 4: sc_i = s[i] & 63,
    m_i = s[4+i] & 63, sc_{4+i} = (s[8+i] & 15) | (s[i] >> 6) << 4, m_{4+i} = (s[8+i] >> 4) | (s[4+i] >> 6) << 4;
    they are decoded as four 4-lane vectors per block and row into sm = [d*sc_0..7, dmin*m_0..7].
    The 128 quant bytes are read as int32 words, `span` bytes per vector: lane i of the vector for window u
    and byte j of each word holds byte p = span*u + 4i + j, whose low (t = 0) / high (t = 1) nibble is weight
    p % 32 of sub-block 2 * (p // 32) + t. x is read permuted to match (xp, `order`)."""
    lanes = vec.lanes
    span = 4 * lanes
    value = _nibble_value(0.0)
    bb, qs = (176, 48) if fifth_bit else (144, 16)        # block bytes, offset of the nibbles

    def high(i):
        return _f32(tirx.bitwise_and(i, _ints(1, i))) * tirx.Broadcast(tirx.const(16.0, "float32"), _lanes(i))

    def qh_words(w, row, b, u, t, j):
        """The fifth bits of the lanes' weights at bit 0 (higher bits ignored by `lookup`)."""
        if span == 64:    # lanes 0-7 (chunk 2u) and 8-15 (chunk 2u + 1) read the same 32 bytes
            half = vec.words(w, row, b * bb + 16, 8)
            return tirx.shift_right(tirx.Shuffle([half, half], list(range(16))), _lane_index(j * 8 + 4 * u + t, 16, 3, 2))
        return vec.shr(vec.words(w, row, b * bb + 16 + span * u % 32), j * 8 + 2 * (span * u // 32) + t)

    def order(g, i):
        """Block-relative weight in lane i of vector g = (u * 2 + t) * 4 + j."""
        j, t, u = g % 4, g // 4 % 2, g // 8
        p = span * u + 4 * i + j
        return p // 32 * 64 + t * 32 + p % 32

    def scale_vector(w, row, b, d, dmin, part):
        """sm[r, 4 * part: 4 * part + 4] (part unrolled): d * sc_0..3, d * sc_4..7, dmin * m_0..3, dmin * m_4..7."""
        lo, mid, hi = (vec.bytes(w, row, b * bb + 4 + 4 * i, 4) for i in range(3))   # s[0:4], s[4:8], s[8:12]
        top = lambda v: tirx.shift_left(vec.shr(v, 6), _ints(4, v))
        low6 = lambda v: tirx.bitwise_and(v, _ints(63, v))
        scale_hi = tirx.bitwise_or(tirx.bitwise_and(hi, _ints(15, hi)), top(lo))
        min_hi = tirx.bitwise_or(vec.shr(hi, 4), top(mid))
        pick = lambda a, b2, c, e: tirx.if_then_else(part == 0, a, tirx.if_then_else(
            part == 1, b2, tirx.if_then_else(part == 2, c, e)))
        return pick(vec.bcast(d, 4), vec.bcast(d, 4), vec.bcast(dmin, 4), vec.bcast(dmin, 4)) * _f32(
            pick(low6(lo), scale_hi, low6(mid), min_hi))

    def lane_scales(sm, r, u, t):
        if lanes == 16:   # lanes 0-7 lie in chunk 2u, lanes 8-15 in chunk 2u + 1
            return vec.permute(sm[r, vec.at(0, 16)], _lane_index(4 * u + t, 16, 3, 2))
        return vec.bcast(sm[r, span * u // 32 * 2 + t])

    def weight(w, row, b, u, t, j, words):
        q = vec.lookup(vec.shr(words, j * 8 + t * 4), value)
        return q + vec.lookup(qh_words(w, row, b, u, t, j), high) if fifth_bit else q

    def dot(xp, w, row, b, u, t, tok):
        words = vec.words(w, row, b * bb + qs + span * u)
        return _sum([xp[tok, vec.at(b * 256 + ((u * 2 + t) * 4 + j) * lanes)] * weight(w, row, b, u, t, j, words)
                     for j in range(4)])

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        # Rows innermost over the quants: each xp vector is loaded once for all rows of the group.
        sm = T.alloc_buffer((rows, 16), "float32", scope="global", annotations=STACK)
        for r in T.unroll(rows):
            d = widen(wh[T.min(first + r, n - 1), b * (bb // 2)], "float16", vec.f16c)
            dmin = widen(wh[T.min(first + r, n - 1), b * (bb // 2) + 1], "float16", vec.f16c)
            for part in T.unroll(4):
                sm[r, vec.at(part * 4, 4)] = scale_vector(w, T.min(first + r, n - 1), b, d, dmin, part)
            for s in T.unroll(group):
                accm[s, r, vec.at(0, 8)] = accm[s, r, vec.at(0, 8)] + sm[r, vec.at(8, 8)] * xsum[
                    _token(p, s, group, m), vec.at(b * 8, 8)]
        for u in T.unroll(128 // span):
            for t in T.unroll(2):
                for r in T.unroll(rows):
                    for s in T.unroll(group):
                        acc[s, r, vec.at(0)] = acc[s, r, vec.at(0)] + lane_scales(sm, r, u, t) * dot(
                            xp, w, T.min(first + r, n - 1), b, u, t, _token(p, s, group, m))

    return block_dot, order


def _q3_k(vec: _Vectors, rows: int, group: int, m: int):
    """Block b (110 B): weight 128h + 32c + l (half h, c < 4, l < 32) is q = (bits 2c of qs byte 32h + l) |
    (bit 4h + c of hmask byte l) << 2, minus 4; qs at byte 32, hmask at 0, the 12 scale bytes at 96, d (fp16) at
    108. Sub-block j = weight // 16 has the 6-bit scale (nibble j // 8 of byte j % 8) | (bits 2(j // 4) of byte
    8 + j % 4) << 4, minus 32; acc += d * sc_j * sum x*q per sub-block (sm = d * sc as 16 lanes per block and
    row). The 64 qs bytes are read as int32 words, `span` bytes per vector: lane i of window u, byte j, shift
    c is byte p = span*u + 4i + j of qs, weight 128 (p // 32) + 32c + p % 32; x is read permuted to match."""
    lanes = vec.lanes
    span = 4 * lanes
    windows = 64 // span
    four = tirx.Broadcast(tirx.const(4.0, "float32"), lanes)

    def order(g, i):
        """Block-relative weight in lane i of vector g = (u * 4 + c) * 4 + j."""
        j, c, u = g % 4, g // 4 % 4, g // 16
        p = span * u + 4 * i + j
        return 128 * (p // 32) + 32 * c + p % 32

    def high_words(w, row, b, u, c, j):
        """The hmask bits of the lanes' weights at bit 0 (higher bits masked by the caller)."""
        if span == 64:    # lanes 0-7 (half 0) and 8-15 (half 1) read the same 32 bytes, at bits c and 4 + c
            half = vec.words(w, row, b * 110, 8)
            return tirx.shift_right(tirx.Shuffle([half, half], list(range(16))), _lane_index(j * 8 + c, 16, 3, 4))
        return vec.shr(vec.words(w, row, b * 110 + span * u % 32), j * 8 + 4 * (span * u // 32) + c)

    def lane_scales(sm, r, u, c):
        """d * sc of each lane's sub-block 8h + 2c + (p % 32) // 16."""
        if lanes == 16:
            ramp = tirx.Ramp(tirx.const(0, "int32"), 1, 16)
            index = tirx.Broadcast(tirx.Cast("int32", 2 * c), 16) + tirx.shift_right(ramp, _ints(3, ramp)) * _ints(8, ramp) \
                + tirx.bitwise_and(tirx.shift_right(ramp, _ints(2, ramp)), _ints(1, ramp))
            return vec.permute(sm[r, vec.at(0, 16)], index)
        if lanes == 8:
            return vec.permute(sm[r, vec.at(8 * u, 8)], _lane_index(2 * c, 8, 2, 1))
        return vec.bcast(sm[r, 8 * (u // 2) + 2 * c + u % 2])

    def dot(xp, w, row, b, u, c, tok):
        qs = vec.words(w, row, b * 110 + 32 + span * u)
        terms = []
        for j in range(4):
            low = tirx.bitwise_and(vec.shr(qs, j * 8 + 2 * c), _ints(3, qs))
            hb = tirx.shift_left(tirx.bitwise_and(high_words(w, row, b, u, c, j), _ints(1, qs)), _ints(2, qs))
            terms.append(xp[tok, vec.at(b * 256 + ((u * 4 + c) * 4 + j) * lanes)] * (_f32(tirx.bitwise_or(low, hb)) - four))
        return _sum(terms)

    def scale_part(w, row, b, d, q):
        """d * (sc_j - 32) for j = 4q .. 4q + 3."""
        low = vec.bytes(w, row, b * 110 + 96 + 4 * (q % 2), 4)
        low = tirx.bitwise_and(vec.shr(low, 4 * (q // 2)), _ints(15, low))
        top = tirx.bitwise_and(vec.shr(vec.bytes(w, row, b * 110 + 104, 4), 2 * q), _ints(3, low))
        six = tirx.bitwise_or(low, tirx.shift_left(top, _ints(4, low)))
        return vec.bcast(d, 4) * (_f32(six) - tirx.Broadcast(tirx.const(32.0, "float32"), 4))

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        # Rows innermost over the quants: each xp vector is loaded once for all rows of the group.
        sm = T.alloc_buffer((rows, 16), "float32", scope="global", annotations=STACK)   # d * sc_j
        for r in T.unroll(rows):
            d = widen(wh[T.min(first + r, n - 1), b * 55 + 54], "float16", vec.f16c)
            for q in T.unroll(4):
                sm[r, vec.at(q * 4, 4)] = scale_part(w, T.min(first + r, n - 1), b, d, q)
        for u in T.unroll(windows):
            for c in T.unroll(4):
                for r in T.unroll(rows):
                    for s in T.unroll(group):
                        acc[s, r, vec.at(0)] = acc[s, r, vec.at(0)] + lane_scales(sm, r, u, c) * dot(
                            xp, w, T.min(first + r, n - 1), b, u, c, _token(p, s, group, m))

    return block_dot, order


def _q6_k(vec: _Vectors, rows: int, group: int, m: int):
    """Block b: weight 128h + 32c + l (half h, quarter c, l < 32) is q = ql | qh << 4 - 32 with ql the nibble
    c // 2 of byte 64h + 32(c % 2) + l and qh bits 2c..2c+1 of byte 128 + 32h + l; sub-block j = weight // 16
    has the int8 scale at byte 192 + j, d (fp16) is at byte 208. acc += d * sc_j * sum x*q per sub-block
    (sm = d * sc as one 16-lane vector per block and row). q is two table lookups: ql, (qh & 3) * 16 - 32.
    ql is read as int32 words, `span` bytes per vector: lane i of window u, byte j, nibble t is byte
    p = span*u + 4i + j of the half, weight 128h + 64t + p; x is read permuted to match (xp, `order`)."""
    lanes = vec.lanes
    span = 4 * lanes
    windows = 64 // span             # ql vectors per half and nibble
    low = _nibble_value(0.0)

    def high(i):
        return _f32(tirx.bitwise_and(i, _ints(3, i))) * tirx.Broadcast(tirx.const(16.0, "float32"), _lanes(i)) \
            - tirx.Broadcast(tirx.const(32.0, "float32"), _lanes(i))

    def order(g, i):
        """Block-relative weight in lane i of vector g = ((h * 2 + t) * windows + u) * 4 + j."""
        j, u, t, h = g % 4, g // 4 % windows, g // (4 * windows) % 2, g // (8 * windows)
        return h * 128 + t * 64 + span * u + 4 * i + j

    def qh_words(w, row, b, h, t, u, j):
        """The qh bits of the lanes' weights, shifted to bit 0: byte p % 32 of the half's 32, bits 2c with
        c = 2t + p // 32."""
        if span == 64:    # lanes 0-7 and 8-15 read the same 32 bytes, at bits 4t and 4t + 2
            half = vec.words(w, row, b * 210 + 128 + h * 32, 8)
            return tirx.shift_right(tirx.Shuffle([half, half], list(range(16))), _lane_index(j * 8 + t * 4, 16, 3, 2))
        return vec.shr(vec.words(w, row, b * 210 + 128 + h * 32 + span * u % 32), j * 8 + (t * 2 + span * u // 32) * 2)

    def lane_scales(sm, r, h, t, u):
        """d * sc of each lane's sub-block 8h + 4t + (span*u + 4i) // 16."""
        if lanes == 16:
            return vec.permute(sm[r, vec.at(0, 16)], _lane_index(h * 8 + t * 4, 16, 2, 1))
        if lanes == 8:
            return vec.permute(sm[r, vec.at(h * 8, 8)], _lane_index(t * 4 + u * 2, 8, 2, 1))
        return vec.bcast(sm[r, h * 8 + t * 4 + u])

    def dot(xp, w, row, b, h, t, u, tok):
        ql = vec.words(w, row, b * 210 + h * 64 + span * u)
        return _sum([xp[tok, vec.at(b * 256 + (((h * 2 + t) * windows + u) * 4 + j) * lanes)] * (
            vec.lookup(vec.shr(ql, j * 8 + t * 4), low) + vec.lookup(qh_words(w, row, b, h, t, u, j), high))
            for j in range(4)])

    @T.macro
    def block_dot(x, xp, w, wi, wh, xsum, acc, accm, n, first, b, p):
        # Rows innermost over the quants: each xp vector is loaded once for all rows of the group.
        sm = T.alloc_buffer((rows, 16), "float32", scope="global", annotations=STACK)   # d * sc_j
        for r in T.unroll(rows):
            sm[r, vec.at(0, 16)] = vec.bcast(widen(wh[T.min(first + r, n - 1), b * 105 + 104], "float16", vec.f16c),
                                             16) * _f32(wi[T.min(first + r, n - 1), vec.at(b * 210 + 192, 16)])
        for h in T.unroll(2):
            for t in T.unroll(2):
                for u in T.unroll(windows):
                    for r in T.unroll(rows):
                        for s in T.unroll(group):
                            acc[s, r, vec.at(0)] = acc[s, r, vec.at(0)] + lane_scales(sm, r, h, t, u) * dot(
                                xp, w, T.min(first + r, n - 1), b, h, t, u, _token(p, s, group, m))

    return block_dot, order


_BLOCK_DOT = {"q8_0": _q8_0, "q4_0": _q4_0, "q5_0": _q5_0, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
              "iq4_xs": _iq4_xs, "mxfp4": mxfp4_block_dot}
