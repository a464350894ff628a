"""Decode GEMV over k-quant weights (q3_k, q4_k, q5_k, q6_k) against int8 activations (dp4a): llama.cpp's mmvq
arithmetic, in TIR.

Why not quant_gemv.py's fp32 path for these types: it turns every quant into an fp32 (2-3 integer ops and an
FADD) and every activation into an fp32 (a conversion-unit op: 16 results / clock / SM on an H100 against 128
FP32 ops), about 5.5 issue slots per weight; a Qwen3-8B Q4_K_M token then needs ~1.4 ms of issue per SM beside
~1.6 ms of HBM reads, and the two overlap badly (measured: 1.3 TB/s on its largest GEMV). Here a weight costs
about one slot: four nibbles are masked out of a 32-bit word at once and one dp4a multiplies them with four int8
activations and adds.

Activations: each CTA quantizes x[m, k] into shared memory, per 32 consecutive values (ggml's q8_1 block):
dx = amax / 127, xq = rint(x * 127 / amax) (the rounding by adding 1.5 * 2^23: the int8 is the low byte of the
sum's bits). x is read from L2 once per CTA (a CTA holds warps * rows_per_warp weight rows). Shared memory is
static and below 48 KiB, so x goes through in chunks of whole 1024-weight spans when m * k is large (a batched
step); a lane's blocks and the order it adds them are the same for every chunking, so row t of y is bit-identical
to a 1-row call on x[t] (batch invariance).

Weights: the raw GGUF rows, uint8 [n, row_bytes] (formats in quant_gemv.py). Lane t of the 8 that share a block:
- q4_k (16-byte aligned blocks): 16 quant bytes, 4 words, = positions 64(t//2) + 16(t%2) + [0, 16) of sub-block
  pair t//2: low nibbles sub-block 2(t//2), high ones 2(t//2) + 1. dot = dx * (d*sc * sum(q*xq) - dmin*m * sum(xq))
  over each run of 16 (q in 0..15).
- q5_k (176-byte blocks, 16-byte aligned): q4_k's runs, each quant byte's fifth bit from qh bytes 16(t%2) + [0, 16)
  (bit 2(t//2) + g for run g) OR-ed above the nibble as the words are decoded (q in 0..31, two words per 4 quant
  bytes); q4_k's dot.
- q6_k (2-byte aligned blocks: read as uint16 and paired into words): 4 runs of 8 positions 128(t//4) + 32c +
  8(t%4), q = low nibble | 2 high bits << 4 (0..63): dot = dx * d*sc * (sum(q*xq) - 32 * sum(xq)).
- q3_k (2-byte aligned, as q6_k): q6_k's runs, q = 2 bits of qs | the hmask bit << 2 (0..7), the 6-bit scale less
  32 (sub-blocks of 16): dot = dx * d*(sc - 32) * (sum(q*xq) - 4 * sum(xq)).
dp4a sums stay below 2^22, so they become fp32 exactly by the same 1.5 * 2^23 trick (no I2F).
Results: y = x_q @ dequant(W)^T with x_q the int8 activations times dx, summed in fp32 (the reference the tests
use); against fp16 x the int8 rounding adds ~0.5% of |y| (what llama.cpp's CUDA decode computes too).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.errors import HelmcError
from helmc.schedules.gpu.quant_gemv import (FORMATS, WARP, _check, _field, _half, _q4_k_scale_min, _signed_byte,
                                            _unsigned)

INT8_TYPES = ("q3_k", "q4_k", "q5_k", "q6_k")
_AFFINE = ("q4_k", "q5_k")      # two runs of 16 per lane, w = d*sc*q - dmin*m; the others four runs of 8
_OFFSET = {"q3_k": 4, "q6_k": 32}   # w = d*sc * (q - offset)
EPILOGUES = (None, "residual", "swiglu")     # as schedules/gpu/gemv.py's
X_BLOCK = 32                # activations per int8 scale (ggml's q8_1 block)
PIECE = 8                   # activations one thread quantizes: one 16-byte load
SPAN = 1024                 # chunks of x are whole spans: 4 blocks of 256 per warp step
SMEM_BUDGET = 40 * 1024     # static shared memory of a CTA (CUDA's static limit is 48 KiB)
PRELOAD = 6                 # x-quantizing passes whose loads go out together (6: all of k = 12288 at m = 1)
ROWS_PER_WARP, WARPS, UNROLL = 2, 4, 2
_MAGIC = 12582912.0         # 1.5 * 2^23: for |v| < 2^22, v + MAGIC holds rint(v) in its low mantissa bits
_MAGIC_BITS = 0x4B400000
_ONES = 0x01010101
_F32 = "float32"


def gemv_int8_symbol(qtype: str, n, k: int, rows_per_warp: int = ROWS_PER_WARP, warps: int = WARPS,
                     unroll: int = UNROLL, k_split: bool = False, m: int = 1, epilogue: str | None = None) -> str:
    """n: the row count, or a tuple of them for a kernel over several weights of one x (n4096_1024_1024)."""
    n = "_".join(map(str, n)) if isinstance(n, (tuple, list)) else n
    tuned = (rows_per_warp, warps, unroll, k_split) != (ROWS_PER_WARP, WARPS, UNROLL, False)
    tail = (f"_m{m}" if m != 1 else "") + (f"_r{rows_per_warp}w{warps}u{unroll}{'s' if k_split else ''}"
                                           if tuned else "")
    kind = {None: "", "residual": "res_", "swiglu": "swiglu_"}[epilogue]
    return f"helmc_gpu_gemv8_{kind}{qtype}_n{n}_k{k}{tail}"


def x_chunk(m: int, k: int, spans: int = 1) -> int:
    """Activations per row of x held in shared memory at once: all of k when m * k fits, else whole groups of
    `spans` SPANs (a k_split kernel's warps take a span each per step: a chunk of whole steps keeps every lane's
    blocks, and so its sums, those of the unchunked call)."""
    per_value = 1 + 4 / X_BLOCK                     # an int8 and a share of its block's fp32 scale
    if m * k * per_value <= SMEM_BUDGET:
        return k
    unit = SPAN * spans
    chunk = int(SMEM_BUDGET / (m * per_value)) // unit * unit
    if chunk < unit:
        raise HelmcError(f"GPU int8 GEMV: m * {unit} activations must fit {SMEM_BUDGET} bytes of shared memory, "
                         f"found m={m}")
    return chunk


def _to_float(i):
    """fp32 of an int32 |i| < 2^22, exactly, with an integer add and an FADD."""
    return T.reinterpret(_F32, T.int32(_MAGIC_BITS) + i) - T.float32(_MAGIC)


def _dp4a(a, b, c):
    return T.call_pure_extern("int32", "__dp4a", a, b, c)


def _i32(word):
    return T.reinterpret("int32", word)


def _pair(lo, hi):
    """uint32 of two uint16 halves."""
    return T.bitwise_or(T.Cast("uint32", lo), T.shift_left(T.Cast("uint32", hi), T.uint32(16)))


def _decode_q4_k():
    @T.macro
    def decode(wv, base, t, qw, s1, s2, r):
        """qw[r, 0..4): the lane's 16 quant bytes; s1[r, g] = d*sc, s2[r, g] = dmin*m of sub-block 2(t//2) + g."""
        head = T.alloc_buffer((4,), "uint32", scope="local")
        for v in T.vectorized(4):
            head[v] = wv[base + v]
        for v in T.vectorized(4):
            qw[r, v] = wv[base + 4 + 8 * (t // 2) + 4 * (t % 2) + v]
        for g in T.unroll(2):
            s1[r, g] = _half(head[0]) * _unsigned(_q4_k_scale_min(head, t, g, 1, 0), 0)
            s2[r, g] = _half(T.shift_right(head[0], T.uint32(16))) * _unsigned(_q4_k_scale_min(head, t, g, 2, 4), 0)

    return decode


def _decode_q5_k():
    @T.macro
    def decode(wv, base, t, qw, s1, s2, r):
        """qw[r, 4g + j]: run g's quants 4j..4j+3 (0..31) as bytes; s1 / s2 as q4_k's."""
        head = T.alloc_buffer((4,), "uint32", scope="local")
        qh = T.alloc_buffer((4,), "uint32", scope="local")     # qh bytes 16(t%2) .. +16
        qs = T.alloc_buffer((4,), "uint32", scope="local")     # quant bytes 32(t//2) + 16(t%2) .. +16
        for v in T.vectorized(4):
            head[v] = wv[base + v]
        for v in T.vectorized(4):
            qh[v] = wv[base + 4 + 4 * (t % 2) + v]
        for v in T.vectorized(4):
            qs[v] = wv[base + 12 + 8 * (t // 2) + 4 * (t % 2) + v]
        for g in T.unroll(2):
            for j in T.unroll(4):
                qw[r, 4 * g + j] = T.bitwise_or(_field(qs[j], 4 * g, 0x0F0F0F0F), T.shift_left(
                    _field(qh[j], 2 * (t // 2) + g, 0x01010101), T.uint32(4)))
            s1[r, g] = _half(head[0]) * _unsigned(_q4_k_scale_min(head, t, g, 1, 0), 0)
            s2[r, g] = _half(T.shift_right(head[0], T.uint32(16))) * _unsigned(_q4_k_scale_min(head, t, g, 2, 4), 0)

    return decode


def _decode_q3_k():
    @T.macro
    def decode(wv, base, t, qw, s1, s2, r):
        """qw[r, 2c + j]: run c's quants 4j..4j+3 (0..7) as bytes; s1[r, c] = d * (sc - 32) of run c's sub-block
        8(t//4) + 2c + (t%4)//2 (its 6 bits: nibble t//4 of scale byte 2c + (t%4)//2, and above them bits
        4(t//4) + 2(c//2) of byte 8 + 2(c%2) + (t%4)//2)."""
        qs = T.alloc_buffer((4,), "uint16", scope="local")     # qs bytes 32(t//4) + 8(t%4) .. +8 (at byte 32)
        hm = T.alloc_buffer((4,), "uint16", scope="local")     # hmask bytes 8(t%4) .. +8
        sc = T.alloc_buffer((6,), "uint16", scope="local")     # the 12 scale bytes (at byte 96)
        for j in T.unroll(4):
            qs[j] = wv[base + 16 + 16 * (t // 4) + 4 * (t % 4) + j]
        for j in T.unroll(4):
            hm[j] = wv[base + 4 * (t % 4) + j]
        for j in T.unroll(6):
            sc[j] = wv[base + 48 + j]
        for c in T.unroll(4):
            for j in T.unroll(2):
                qw[r, 2 * c + j] = T.bitwise_or(
                    _field(_pair(qs[2 * j], qs[2 * j + 1]), 2 * c, 0x03030303),
                    T.shift_left(_field(_pair(hm[2 * j], hm[2 * j + 1]), 4 * (t // 4) + c, 0x01010101), T.uint32(2)))
            s1[r, c] = _half(wv[base + 54]) * _unsigned(T.bitwise_or(
                _field(sc[c], 8 * ((t % 4) // 2) + 4 * (t // 4), 0xF),
                T.shift_left(_field(sc[4 + c % 2], 8 * ((t % 4) // 2) + 4 * (t // 4) + 2 * (c // 2), 3), T.uint32(4))),
                32)

    return decode


def _decode_q6_k():
    @T.macro
    def decode(wv, base, t, qw, s1, s2, r):
        """qw[r, 2c + j]: run c's quants 4j..4j+3 as bytes 0..63; s1[r, c] = d * sc of run c."""
        ql = T.alloc_buffer((8,), "uint16", scope="local")     # ql bytes 64h + 8(t%4) .. +8, then +32 .. +8
        qh = T.alloc_buffer((4,), "uint16", scope="local")     # qh bytes 32h + 8(t%4) .. +8
        sc = T.alloc_buffer((4,), "uint16", scope="local")     # scale pairs 8h + 2c, + 1 for c = 0..3
        for s in T.unroll(2):
            for j in T.unroll(4):
                ql[s * 4 + j] = wv[base + 32 * (t // 4) + 16 * s + 4 * (t % 4) + j]
        for j in T.unroll(4):
            qh[j] = wv[base + 64 + 16 * (t // 4) + 4 * (t % 4) + j]
        for c in T.unroll(4):
            sc[c] = wv[base + 96 + 4 * (t // 4) + c]
        for c in T.unroll(4):
            for j in T.unroll(2):
                qw[r, 2 * c + j] = T.bitwise_or(
                    T.bitwise_and(T.shift_right(_pair(ql[(c % 2) * 4 + 2 * j], ql[(c % 2) * 4 + 2 * j + 1]),
                                                T.uint32(4 * (c // 2))), T.uint32(0x0F0F0F0F)),
                    T.shift_left(T.bitwise_and(T.shift_right(_pair(qh[2 * j], qh[2 * j + 1]), T.uint32(2 * c)),
                                               T.uint32(0x03030303)), T.uint32(4)))
            # positions 8(t%4) < 16 use the first scale of the pair, >= 16 the second
            s1[r, c] = _half(wv[base + 104]) * _signed_byte(_field(sc[c], 8 * ((t % 4) // 2), 0xFF))

    return decode


def int8_kernel_parts(qtype: str, n, k: int, rows_per_warp: int = ROWS_PER_WARP, warps: int = WARPS,
                      unroll: int = UNROLL, k_split: bool = False, m: int = 1, epilogue: str | None = None):
    """The int8 GEMV's CTA body and launch geometry, for make_gpu_gemv_int8's PrimFuncs and for kernels that pick
    their weights at run time (moe_experts.py): (kernel_body(x, weight word views, ys, bx, ty, tx[, residual]),
    grid (CTAs along blockIdx.x), row_words (words per weight row), word_type, rb (bytes per row), outs)."""
    if qtype not in INT8_TYPES:
        raise HelmcError(f"GPU int8 GEMV: a type in {INT8_TYPES} expected, found {qtype!r}")
    outs = tuple(n) if isinstance(n, (tuple, list)) else (n,)
    if not 1 <= len(outs) <= 3:
        raise HelmcError(f"GPU int8 GEMV: 1 to 3 weights expected, found {len(outs)}")
    for n_i in outs:
        fmt = _check(qtype, n_i, k)
    if epilogue not in EPILOGUES or (epilogue and (len(outs) > 1 or k_split)):
        raise HelmcError(f"GPU int8 GEMV: an epilogue in {EPILOGUES[1:]} over one row count without k_split, or "
                         f"none, expected; found n={n}, epilogue={epilogue!r}, k_split={k_split}")
    if rows_per_warp < 1 or unroll < 1 or not 1 <= warps <= 1024 // WARP or m < 1:
        raise HelmcError(f"GPU int8 GEMV: rows_per_warp >= 1, unroll >= 1, 1 <= warps <= 32, m >= 1 expected, "
                         f"found {rows_per_warp}, {unroll}, {warps}, m={m}")
    tpb, weights = fmt.threads, fmt.weights
    word_type = fmt.word                                # the weight view's word: as wide as blocks are aligned
    width = 4 if word_type == "uint32" else 2           # bytes per word of the weight view
    blocks, row_words, block_words = k // weights, k // weights * fmt.bytes // width, fmt.bytes // width
    per_step = WARP // tpb                              # blocks of a row a warp covers per step (4)
    lanes_of_k = warps if k_split else 1               # warps splitting a row's blocks
    chunk = x_chunk(m, k, lanes_of_k)
    chunks = -(-k // chunk)
    assert chunks == 1 or chunk % (per_step * weights * lanes_of_k) == 0, (chunk, per_step)   # a lane's blocks: any chunking
    chunk_blocks = chunk // weights
    steps = -(-chunk_blocks // (per_step * unroll * lanes_of_k))
    rows, threads = rows_per_warp, warps * WARP
    swiglu = epilogue == "swiglu"
    span = rows * (2 if swiglu else 1)                  # a lane's accumulator rows: gate's, then up's
    cta_rows = rows if k_split else rows * warps
    def first_row(cta, ty):
        return cta * rows if k_split else (cta * warps + ty) * rows

    def chunk_block(so, si, ty, tx):
        """The block of the chunk lane tx of warp ty takes at step so * unroll + si (k_split: every warps-th step
        is this warp's)."""
        step = (so * unroll + si) * lanes_of_k + (ty if k_split else 0)
        return step * per_step + tx // tpb
    pieces = m * chunk // PIECE                         # 8-value pieces of one chunk, every row of x
    passes = -(-pieces // threads)
    group = min(passes, PRELOAD)                        # passes whose x loads are in flight together
    groups = -(-passes // group)
    grids = [-(-n_i // cta_rows) for n_i in outs]
    grid = sum(grids)
    nq = 4 if qtype == "q4_k" else 8                    # quant words per lane per row
    ns = 2 if qtype in _AFFINE else 4                   # scales per lane per row
    decode = {"q3_k": _decode_q3_k, "q4_k": _decode_q4_k, "q5_k": _decode_q5_k, "q6_k": _decode_q6_k}[qtype]()
    offset = _OFFSET.get(qtype, 0)

    def quant_word(qw, r, g, j):
        """Run g's quant word j of row r (q4_k: nibble g of its 4 words, masked out here)."""
        if qtype == "q4_k":
            return T.bitwise_and(T.shift_right(qw[r, j], T.uint32(4 * g)), T.uint32(0x0F0F0F0F))
        return qw[r, 4 * g + j]

    @T.macro
    def quantize_pass(xq, xd, ch, tid, tx, xh, xf, amax, inv, word, it, j):
        """Pass `it` of quantize_chunk on its loaded values xh[j]."""
        amax[0] = T.float32(0)
        for v in T.unroll(PIECE):
            xf[v] = T.float32(0)
        if it * threads + tid < pieces and ch * chunk + (it * threads + tid) % (chunk // PIECE) * PIECE < k:
            for v in T.unroll(PIECE):
                xf[v] = T.Cast(_F32, xh[j, v])
                amax[0] = T.max(amax[0], T.abs(xf[v]))
        for s in T.unroll(2):
            amax[0] = T.max(amax[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), amax[0], 1 << s, WARP, WARP))
        if it * threads + tid < pieces and ch * chunk + (it * threads + tid) % (chunk // PIECE) * PIECE < k:
            inv[0] = T.if_then_else(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))
            for w4 in T.unroll(PIECE // 4):
                word[0] = T.uint32(0)
                for b in T.unroll(4):
                    word[0] = T.bitwise_or(word[0], T.shift_left(T.bitwise_and(T.reinterpret(
                        "uint32", xf[4 * w4 + b] * inv[0] + T.float32(_MAGIC)), T.uint32(0xFF)), T.uint32(8 * b)))
                xq[(it * threads + tid) * (PIECE // 4) + w4] = _i32(word[0])
            if tx % (X_BLOCK // PIECE) == 0:
                xd[(it * threads + tid) // (X_BLOCK // PIECE)] = amax[0] / T.float32(127)

    @T.macro
    def quantize_chunk(x, xq, xd, ch, tid, tx, xh, xf, amax, inv, word):
        """xq / xd = chunk `ch` of every row of x as int8 words and per-32 scales; 4 lanes share a 32-block. The
        x loads of `group` passes are issued before any is used: one L2 round trip where there were `group`."""
        for gi in T.serial(groups):
            for j in T.unroll(group):
                if (gi * group + j < passes and (gi * group + j) * threads + tid < pieces
                        and ch * chunk + ((gi * group + j) * threads + tid) % (chunk // PIECE) * PIECE < k):
                    for v in T.vectorized(PIECE):
                        xh[j, v] = x[((gi * group + j) * threads + tid) // (chunk // PIECE),
                                     ch * chunk + ((gi * group + j) * threads + tid) % (chunk // PIECE) * PIECE + v]
            for j in T.unroll(group):
                if gi * group + j < passes:         # CTA-uniform: the shuffles below see every lane
                    quantize_pass(xq, xd, ch, tid, tx, xh, xf, amax, inv, word, gi * group + j, j)

    @T.macro
    def block_step(wv, wv_up, n_rows, xq, xd, acc, first_row, gblock, b, t, qw, s1, s2, xw, dx, sx, dot):
        """acc[tok, r] += row (first_row + r)'s block `gblock` (chunk block b) . x_q[tok], lane t's runs (swiglu:
        acc[tok, rows + r] the same for up's row)."""
        for r in T.unroll(rows):
            decode(wv, T.min(first_row + r, n_rows - 1) * row_words + gblock * block_words, t, qw, s1, s2, r)
        if swiglu:
            for r in T.unroll(rows):
                decode(wv_up, T.min(first_row + r, n_rows - 1) * row_words + gblock * block_words, t, qw, s1, s2,
                       rows + r)
        for tok in T.unroll(m):
            if qtype in _AFFINE:
                for g in T.unroll(2):
                    for v in T.vectorized(4):
                        xw[g * 4 + v] = xq[tok * (chunk // 4) + (b * 256 + 64 * (t // 2) + 32 * g + 16 * (t % 2)) // 4 + v]
                    dx[g] = xd[tok * (chunk // X_BLOCK) + b * 8 + 2 * (t // 2) + g]
                    sx[g] = _dp4a(xw[g * 4], T.int32(_ONES), _dp4a(xw[g * 4 + 1], T.int32(_ONES), _dp4a(
                        xw[g * 4 + 2], T.int32(_ONES), _dp4a(xw[g * 4 + 3], T.int32(_ONES), T.int32(0)))))
                for r in T.unroll(span):
                    for g in T.unroll(2):
                        dot[0] = T.int32(0)
                        for j in T.unroll(4):
                            dot[0] = _dp4a(_i32(quant_word(qw, r, g, j)), xw[g * 4 + j], dot[0])
                        acc[tok, r] = acc[tok, r] + dx[g] * (s1[r, g] * _to_float(dot[0]) - s2[r, g] * _to_float(sx[g]))
            else:
                for c in T.unroll(4):
                    for v in T.vectorized(2):
                        xw[c * 2 + v] = xq[tok * (chunk // 4) + (b * 256 + 128 * (t // 4) + 32 * c + 8 * (t % 4)) // 4 + v]
                    dx[c] = xd[tok * (chunk // X_BLOCK) + b * 8 + 4 * (t // 4) + c]
                    sx[c] = _dp4a(xw[c * 2], T.int32(_ONES), _dp4a(xw[c * 2 + 1], T.int32(_ONES), T.int32(0)))
                for r in T.unroll(span):
                    for c in T.unroll(4):
                        dot[0] = _dp4a(_i32(qw[r, 2 * c]), xw[c * 2], _dp4a(_i32(qw[r, 2 * c + 1]), xw[c * 2 + 1],
                                                                             T.int32(0)))
                        acc[tok, r] = acc[tok, r] + dx[c] * s1[r, c] * _to_float(dot[0] - offset * sx[c])

    @T.macro
    def weight_rows(x, wv, y, n_rows, cta, ty, tx, xq, xd, acc, xh, xf, amax, inv, word, qw, s1, s2, xw, dx, sx, dot,
                    red, wv_up=None, res=None, gu=None):
        """y[:, rows of CTA `cta`] for one weight of n_rows rows: x quantized chunk by chunk, the warp's rows summed
        (k_split: every warp's share of the CTA's rows, then the warps' sums in order)."""
        for tok in T.unroll(m):
            for r in T.unroll(span):
                acc[tok, r] = T.float32(0)
        for ch in T.serial(chunks):
            T.tvm_storage_sync("shared")          # the previous chunk is read by every warp
            quantize_chunk(x, xq, xd, ch, ty * WARP + tx, tx, xh, xf, amax, inv, word)
            T.tvm_storage_sync("shared")
            for so in T.serial(steps):
                for si in T.unroll(unroll):
                    if (chunk_block(so, si, ty, tx) < chunk_blocks
                            and ch * chunk_blocks + chunk_block(so, si, ty, tx) < blocks):
                        block_step(wv, wv_up, n_rows, xq, xd, acc, first_row(cta, ty),
                                   ch * chunk_blocks + chunk_block(so, si, ty, tx), chunk_block(so, si, ty, tx),
                                   tx % tpb, qw, s1, s2, xw, dx, sx, dot)
        for tok in T.unroll(m):
            for r in T.unroll(span):
                for s in T.unroll(5):             # butterfly: every lane ends with the warp's sum
                    acc[tok, r] = acc[tok, r] + T.tvm_warp_shuffle_xor(
                        T.uint32(0xFFFFFFFF), acc[tok, r], 16 >> s, WARP, WARP)
            for r in T.unroll(rows):
                if k_split:
                    if tx == (tok * rows + r) % WARP:
                        red[(ty * m + tok) * rows + r] = acc[tok, r]
                elif tx == (tok * rows + r) % WARP and (cta * warps + ty) * rows + r < n_rows:
                    if swiglu:
                        gu[0] = T.Cast("float16", acc[tok, r])
                        gu[1] = T.Cast("float16", acc[tok, rows + r])
                        y[tok, (cta * warps + ty) * rows + r] = gu[0] * T.sigmoid(gu[0]) * gu[1]
                    elif epilogue == "residual":
                        y[tok, (cta * warps + ty) * rows + r] = res[tok, (cta * warps + ty) * rows + r] + T.Cast(
                            "float16", acc[tok, r])
                    else:
                        y[tok, (cta * warps + ty) * rows + r] = T.Cast("float16", acc[tok, r])
        if k_split:
            T.tvm_storage_sync("shared")
            for tok in T.unroll(m):
                for r in T.unroll(rows):
                    if ty == 0 and tx == (tok * rows + r) % WARP and cta * rows + r < n_rows:
                        acc[tok, r] = red[tok * rows + r]
                        for w in T.serial(1, warps):
                            acc[tok, r] = acc[tok, r] + red[(w * m + tok) * rows + r]
                        y[tok, cta * rows + r] = T.Cast("float16", acc[tok, r])

    @T.macro
    def kernel_body(x, wvs, ys, bx, ty, tx, res=None):
        xq = T.alloc_buffer((m * chunk // 4,), "int32", scope="shared")        # [m, chunk / 4] int8 x4
        xd = T.alloc_buffer((m * chunk // X_BLOCK,), _F32, scope="shared")     # [m, chunk / 32]
        acc = T.alloc_buffer((m, span), _F32, scope="local")
        xh = T.alloc_buffer((group, PIECE), "float16", scope="local")
        xf = T.alloc_buffer((PIECE,), _F32, scope="local")
        amax = T.alloc_buffer((1,), _F32, scope="local")
        inv = T.alloc_buffer((1,), _F32, scope="local")
        word = T.alloc_buffer((1,), "uint32", scope="local")
        qw = T.alloc_buffer((span, nq), "uint32", scope="local")
        s1 = T.alloc_buffer((span, ns), _F32, scope="local")
        s2 = T.alloc_buffer((span, ns), _F32, scope="local")
        gu = T.alloc_buffer((2,), "float16", scope="local")
        xw = T.alloc_buffer((8,), "int32", scope="local")
        dx = T.alloc_buffer((ns,), _F32, scope="local")
        sx = T.alloc_buffer((ns,), "int32", scope="local")
        dot = T.alloc_buffer((1,), "int32", scope="local")
        red = T.alloc_buffer((warps * m * rows if k_split else 1,), _F32, scope="shared")   # [warps, m, rows]
        # each CTA works for one weight (the CTAs of weight i follow those of weight i - 1): bx-uniform branches
        if len(outs) == 1:
            weight_rows(x, wvs[0], ys[0], outs[0], bx, ty, tx, xq, xd, acc, xh, xf, amax, inv, word, qw, s1, s2,
                        xw, dx, sx, dot, red, wvs[-1], res, gu)
        elif len(outs) == 2:
            if bx < grids[0]:
                weight_rows(x, wvs[0], ys[0], outs[0], bx, ty, tx, xq, xd, acc, xh, xf, amax, inv, word, qw, s1, s2,
                            xw, dx, sx, dot, red)
            else:
                weight_rows(x, wvs[1], ys[1], outs[1], bx - grids[0], ty, tx, xq, xd, acc, xh, xf, amax, inv, word,
                            qw, s1, s2, xw, dx, sx, dot, red)
        else:
            if bx < grids[0]:
                weight_rows(x, wvs[0], ys[0], outs[0], bx, ty, tx, xq, xd, acc, xh, xf, amax, inv, word, qw, s1, s2,
                            xw, dx, sx, dot, red)
            elif bx < grids[0] + grids[1]:
                weight_rows(x, wvs[1], ys[1], outs[1], bx - grids[0], ty, tx, xq, xd, acc, xh, xf, amax, inv, word,
                            qw, s1, s2, xw, dx, sx, dot, red)
            else:
                weight_rows(x, wvs[2], ys[2], outs[2], bx - grids[0] - grids[1], ty, tx, xq, xd, acc, xh, xf, amax,
                            inv, word, qw, s1, s2, xw, dx, sx, dot, red)

    rb = k // weights * fmt.bytes                       # bytes per weight row
    return kernel_body, grid, row_words, word_type, rb, outs


def make_gpu_gemv_int8(qtype: str, n, k: int, rows_per_warp: int = ROWS_PER_WARP, warps: int = WARPS,
                       unroll: int = UNROLL, k_split: bool = False, m: int = 1,
                       epilogue: str | None = None) -> tirx.PrimFunc:
    """PrimFunc(x: float16[m, k], w: uint8[n, row_bytes], y: float16[m, n]): y = int8(x) @ dequant(w)^T.

    qtype "q3_k" | "q4_k" | "q5_k" | "q6_k"; k a multiple of 256 (HelmcError otherwise). Row t of y is
    bit-identical to the 1-row kernel's on x[t] (same tuning). x, w, y 16-byte aligned (TVM and CuPy allocations are).
    n a tuple of 2 or 3 row counts: one launch over that many weights of the same x (q, k, v; gate, up):
    PrimFunc(x, w0, w1[, w2], y0, y1[, y2]); each CTA works for one weight, and y_i is bit-identical to the
    one-weight kernel's (the same lanes, blocks and order).
    k_split: the CTA's warps share its rows_per_warp rows and take every warps-th step of their blocks (more CTAs
    and more loads in flight for a short row count: 4096 rows made 256 CTAs of 16 rows for 132 SMs); their
    sums meet in shared memory and add in warp order, the same for every m (batch invariance holds).
    epilogue (one row count, no k_split), as gemv.py's: "residual": PrimFunc(x, w, r, y), y = r + fp16(x @ w^T)
    added in fp16; "swiglu": PrimFunc(x, wg, wu, y), y = silu(g) * u of g, u = fp16(x @ wg^T), fp16(x @ wu^T)
    in fp16 ops, the stage's elementwise kernel's expression: a warp sums its rows of both weights (the lanes,
    blocks and order of the one-weight kernel's), so y is the bits of the GEMVs and that kernel run apart."""
    kernel_body, grid, row_words, word_type, rb, outs = int8_kernel_parts(qtype, n, k, rows_per_warp, warps, unroll,
                                                                          k_split, m, epilogue)
    swiglu = epilogue == "swiglu"
    if epilogue == "residual":
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w: T.Buffer((outs[0], rb), "uint8"),
                 r: T.Buffer((m, outs[0]), "float16"), y: T.Buffer((m, outs[0]), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            wv = T.decl_buffer((outs[0] * row_words,), word_type, data=w.data)      # [n * row_bytes / width]
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        kernel_body(x, [wv], [y], bx, ty, tx, r)
    elif swiglu:
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), wg: T.Buffer((outs[0], rb), "uint8"),
                 wu: T.Buffer((outs[0], rb), "uint8"), y: T.Buffer((m, outs[0]), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            gv = T.decl_buffer((outs[0] * row_words,), word_type, data=wg.data)
            uv = T.decl_buffer((outs[0] * row_words,), word_type, data=wu.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        kernel_body(x, [gv, uv], [y], bx, ty, tx)
    elif len(outs) == 1:
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w: T.Buffer((outs[0], rb), "uint8"), y: T.Buffer((m, outs[0]), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            wv = T.decl_buffer((outs[0] * row_words,), word_type, data=w.data)      # [n * row_bytes / width]
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        kernel_body(x, [wv], [y], bx, ty, tx)
    elif len(outs) == 2:
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w0: T.Buffer((outs[0], rb), "uint8"),
                 w1: T.Buffer((outs[1], rb), "uint8"), y0: T.Buffer((m, outs[0]), "float16"),
                 y1: T.Buffer((m, outs[1]), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            wv0 = T.decl_buffer((outs[0] * row_words,), word_type, data=w0.data)
            wv1 = T.decl_buffer((outs[1] * row_words,), word_type, data=w1.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        kernel_body(x, [wv0, wv1], [y0, y1], bx, ty, tx)
    else:
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w0: T.Buffer((outs[0], rb), "uint8"),
                 w1: T.Buffer((outs[1], rb), "uint8"), w2: T.Buffer((outs[2], rb), "uint8"),
                 y0: T.Buffer((m, outs[0]), "float16"), y1: T.Buffer((m, outs[1]), "float16"),
                 y2: T.Buffer((m, outs[2]), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            wv0 = T.decl_buffer((outs[0] * row_words,), word_type, data=w0.data)
            wv1 = T.decl_buffer((outs[1] * row_words,), word_type, data=w1.data)
            wv2 = T.decl_buffer((outs[2] * row_words,), word_type, data=w2.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        kernel_body(x, [wv0, wv1, wv2], [y0, y1, y2], bx, ty, tx)

    return gemv.with_attr("global_symbol", gemv_int8_symbol(qtype, outs, k, rows_per_warp, warps, unroll, k_split, m,
                                                            epilogue))
