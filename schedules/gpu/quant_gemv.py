"""CUDA kernels (scheduled TIR) over llama.cpp's quantized weights: decode GEMV and dequantize, for the GPU stage.

W is passed as its raw GGUF rows, uint8 [n, row_bytes], each row its blocks along k in ggml's block layouts:
    q8_0 (34 B / 32 w):   d fp16, 32 x int8                                  w = d * q
    q4_0 (18 B / 32 w):   d fp16, 16 B nibbles (w[i] low, w[i+16] high)     w = d * (q - 8)
    q5_0 (22 B / 32 w):   d fp16, qh[4] (bit i: bit 4 of weight i), 16 B nibbles as q4_0's   w = d * (q - 16)
    q3_k (110 B / 256 w): hmask[32], qs[64] 2-bit, 12 B of 6-bit scales for 16 sub-blocks of 16, d fp16
                          (weight 128h + 32c + l: bits 2c of qs[32h + l], bit 4h + c of hmask[l])
                          w = d * (sc_j - 32) * (q - 4)
    q4_k (144 B / 256 w): d, dmin fp16, 12 B of 6-bit (scale, min) for 8 sub-blocks of 32, 128 B nibbles
                          (32-byte chunk c: low nibbles are sub-block 2c, high ones 2c+1)   w = d*sc_j*q - dmin*m_j
    q5_k (176 B / 256 w): q4_k's 16-byte header, qh[32] (bit j of byte l: bit 4 of weight l of sub-block j),
                          128 B nibbles as q4_k's   w = d*sc_j*q - dmin*m_j, q in [0, 31]
    q6_k (210 B / 256 w): 128 B low nibbles, 64 B high 2-bit pairs, 16 x int8 scales (sub-blocks of 16), d fp16
                          (weight 128h + 32c + l: nibble c//2 of ql[64h + 32(c%2) + l], bits 2c of qh[32h + l])
                          w = d * sc_j * (q - 32)
    iq4_xs (136 B / 256 w): d fp16, scales_h u16, scales_l[4] (6-bit scales of 8 sub-blocks of 32), 128 B nibbles
                          (sub-block j: bytes 16j.., as q4_0's)   w = d * (ls_j - 32) * kvalues_iq4nl[q]
    mxfp4 (17 B / 32 w):  e8m0 byte e, 16 B nibbles as q4_0's   w = kvalues_mxfp4[q] * 2^(e - 128) (e2m1 doubled,
                          bit 3 the sign; the scale ggml_e8m0_to_fp32_half: subnormal for e < 2)
(the formulas of ggml's dequantize_row_*, as in schedules/cpu/quant/dequantize.py).

make_gpu_gemv_quant: y[m, n] fp16 = x[m, k] fp16 @ dequant(W)^T, summed in fp32 and rounded once to fp16 at the
end (m = 1 for a decode step, the sequences of a batched one; row t bit-identical to a 1-row call on x[t]): what the GPU stage's decode matmuls compute (rewrite_matmuls_fp32_accumulate: fp16 activations, fp32
accumulation, the cast back fused into the matmul).
make_gpu_dequantize: out[n, k] fp16 = dequant(W), for the prefill path (dequantize, then the fp16 matmul).

Work split (both kernels): each block of a row is read by TPB threads (FORMATS below); thread t of a block
owns `groups` runs of `run` consecutive weights (8 or 16: one or two 16-byte loads of x, or stores of the
output), each run under one scale. Neighbouring threads read neighbouring bytes of the same block, and a
warp covers 32 / TPB consecutive blocks of a row per step, so its loads fall in a few 32-byte sectors.
- Loads are as wide as the block's alignment allows: q4_k blocks (144 B) are 16-byte aligned in every row,
  so its quants and its header are one 16-byte load each (q5_k's 176 B too, and its qh); q8_0 / q4_0 / q5_0 /
  q3_k / q6_k blocks (34, 18, 22, 110, 210 B) are
  only 2-byte aligned (odd blocks of a row start at 2 mod 4), so they are read as uint16 (llama.cpp's
  get_int_b2 does the same); iq4_xs blocks (136 B) are 8-byte aligned, read in 8-byte loads; mxfp4 blocks (17 B)
  start at any byte, so they are read a byte at a time.
- A quant becomes an fp32 by the exponent trick: the integer (or int8 + 128) is OR-ed into the mantissa of
  2^23 and 2^23 (+ the format's offset) is subtracted: one or two integer ops and one FADD, exact. A CUDA
  int-to-float convert (I2F) per weight would run on the conversion unit, listed at 16 results / clock / SM
  in the CUDA guide's throughput table against 128 FP32 ops: ~3.7e12 / s on an H100, a cap near 2 TB/s of
  4-bit weights.
- GEMV: a warp owns ROWS_PER_WARP rows; per step it decodes its rows' quants once, then reads each row of x
  once for all of them (x is read from L1/L2 once per row group, not once per row, and converted to fp32
  once); per run, part = sum x*q (fp32), then acc += scale * part (q4_k also - dmin*m_j * sum x, that sum
  shared by the rows). The warp's lanes are summed with 5 shuffles per row. No shared memory, so nothing
  limits occupancy but registers.
- Dequantize: one thread per (row, block, t), consecutive threads on consecutive pieces of a block.
- Every load and store is in bounds: the last row group clamps its row index for loads and skips stores.
Results: GEMV differs from a float64 reference by fp32 summation (~1e-6 relative) and the final fp16
rounding of y (<= 2^-11 of |y|); dequantize by fp16 rounding of each weight only.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.errors import HelmcError
from helmc.model.spec import QUANT_BLOCKS, check_quant_shape


@dataclass(frozen=True)
class _Format:
    weights: int     # weights per block (along k)
    bytes: int       # bytes per block
    threads: int     # TPB: threads sharing one block
    groups: int      # runs per thread, each under one scale
    run: int         # weights per run: a multiple of 8 (16-byte x loads and output stores)
    word: str        # dtype of the view the block's bytes are loaded through

    @property
    def per_thread(self) -> int:
        return self.groups * self.run


# TPB trades load width against how many blocks (and 32-byte sectors) one warp load touches: 8 threads per
# q4_k / q6_k block and 4 per q8_0 block keep a warp step inside 4-8 consecutive blocks (136-840 bytes).
FORMATS = {"q8_0": _Format(*QUANT_BLOCKS["q8_0"], 4, 1, 8, "uint16"),
           "q4_0": _Format(*QUANT_BLOCKS["q4_0"], 2, 2, 8, "uint16"),
           "q5_0": _Format(*QUANT_BLOCKS["q5_0"], 2, 2, 8, "uint16"),
           "q3_k": _Format(*QUANT_BLOCKS["q3_k"], 8, 4, 8, "uint16"),
           "q4_k": _Format(*QUANT_BLOCKS["q4_k"], 8, 2, 16, "uint32"),
           "q5_k": _Format(*QUANT_BLOCKS["q5_k"], 8, 2, 16, "uint32"),
           "q6_k": _Format(*QUANT_BLOCKS["q6_k"], 8, 4, 8, "uint16"),
           "iq4_xs": _Format(*QUANT_BLOCKS["iq4_xs"], 8, 2, 16, "uint32"),
           "mxfp4": _Format(*QUANT_BLOCKS["mxfp4"], 2, 2, 8, "uint8")}
AFFINE = ("q4_k", "q5_k")   # w = scale * q - offset: the formats with mins
WARP = 32
WARPS = 4              # warps per thread block of the GEMV (128 threads)
ROWS_PER_WARP = 2      # rows one warp reduces at once: x reuse vs. warps in flight (4096 rows -> 15 warps/SM)
UNROLL = 2             # steps along k issued together, so each warp has 2 steps of loads in flight
DEQUANT_THREADS = 256  # threads per thread block of the dequantizer
_INDEX_LIMIT = 2 ** 31  # TIR indexes with int32 here; every flat byte or element index must fit

_F32 = "float32"


def gpu_quant_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one GGUF row of k weights in `qtype`, after checking that k is whole blocks."""
    fmt = _check(qtype, 1, k)
    return k // fmt.weights * fmt.bytes


def gemv_symbol(qtype: str, n: int, k: int, rows_per_warp: int = ROWS_PER_WARP, warps: int = WARPS,
                unroll: int = UNROLL, m: int = 1) -> str:
    """The PrimFunc's global symbol (rows of x other than 1 and a tuning other than the defaults appended); its
    CUDA kernel is this + "_kernel"."""
    tuned = (rows_per_warp, warps, unroll) != (ROWS_PER_WARP, WARPS, UNROLL)
    tail = (f"_m{m}" if m != 1 else "") + (f"_r{rows_per_warp}w{warps}u{unroll}" if tuned else "")
    return f"helmc_gpu_gemv_{qtype}_n{n}_k{k}{tail}"


def dequantize_symbol(qtype: str, n: int, k: int) -> str:
    return f"helmc_gpu_dequantize_{qtype}_n{n}_k{k}"


def _check(qtype: str, n: int, k: int) -> _Format:
    check_quant_shape(qtype, n, k, "GPU quantized kernel")
    fmt = FORMATS[qtype]
    if n * (k // fmt.weights * fmt.bytes) >= _INDEX_LIMIT or n * k >= _INDEX_LIMIT:
        raise HelmcError(f"GPU quantized kernel: n * k expected < 2^31 (int32 indexing), found n={n}, k={k}")
    return fmt


# ------------------------------------------------------------------------------------------------------------
# Quant -> fp32 (see the module docstring: exponent trick, no I2F)
# ------------------------------------------------------------------------------------------------------------
def _u32(v):
    return v if getattr(v, "dtype", None) == "uint32" else tirx.Cast("uint32", v)


def _field(word, shift, mask: int):
    """(word >> shift) & mask as uint32; shift a Python int or a runtime expression."""
    sh = T.uint32(shift) if isinstance(shift, int) else _u32(shift)
    return T.bitwise_and(T.shift_right(_u32(word), sh), T.uint32(mask))


def _unsigned(bits, offset: int):
    """float(bits - offset) for 0 <= bits < 2^23: bits in the mantissa of 2^23, then 2^23 + offset taken off."""
    return T.reinterpret(_F32, T.bitwise_or(bits, T.uint32(0x4B000000))) - T.float32(8388608.0 + offset)


def _signed_byte(byte):
    """float(int8 of byte) for 0 <= byte < 256: flipping bit 7 maps int8 q to q + 128 (as XOR with 2^23's bits)."""
    return T.reinterpret(_F32, T.bitwise_xor(byte, T.uint32(0x4B000080))) - T.float32(8388608.0 + 128)


def _half(bits):
    """fp32 of the fp16 whose bits are the low 16 of `bits`."""
    return T.Cast(_F32, T.reinterpret("float16", T.Cast("uint16", bits)))


# ------------------------------------------------------------------------------------------------------------
# Per format: where thread t's runs sit in the block, and the macro that decodes them.
# decode(wv, base, t, q, scale, offset, r): wv is the row bytes' `word` view, base the block's first index in it;
# q[r, per_thread] gets the quants as fp32 (offsets -8 / -32 already applied), scale[r, g] / offset[r, g] the
# run's w = scale * q - offset (offset only for q4_k); r picks the row of the caller's buffers.
# ------------------------------------------------------------------------------------------------------------
def _run_start(qtype: str, t, g: int):
    """Position in the block (along k) of thread t's run g."""
    if qtype == "q8_0":
        return 8 * t
    if qtype in ("q4_0", "q5_0", "mxfp4"):
        return 16 * g + 8 * t                          # byte 8t + i: low nibble weight 8t+i, high 8t+i+16
    if qtype in AFFINE:
        return 64 * (t // 2) + 32 * g + 16 * (t % 2)   # chunk t//2, its bytes 16(t%2)..+16, nibble g
    if qtype == "iq4_xs":
        return 32 * t + 16 * g                         # sub-block t, its bytes 16t..+16, nibble g
    return 128 * (t // 4) + 32 * g + 8 * (t % 4)      # q3_k / q6_k: half t//4, quarter g, positions 8(t%4)..+8


def _decode_q8_0():
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        u = T.alloc_buffer((4,), "uint16", scope="local")
        for j in T.unroll(4):
            u[j] = wv[base + 1 + 4 * t + j]                        # bytes 2 + 8t + 2j, 2j + 1
        for e in T.unroll(8):
            q[r, e] = _signed_byte(_field(u[e // 2], 8 * (e % 2), 0xFF))
        scale[r, 0] = _half(wv[base])

    return decode


def _decode_q4_0():
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        u = T.alloc_buffer((4,), "uint16", scope="local")
        for j in T.unroll(4):
            u[j] = wv[base + 1 + 4 * t + j]                        # quant bytes 8t + 2j, 2j + 1
        for g in T.unroll(2):
            for i in T.unroll(8):
                q[r, g * 8 + i] = _unsigned(_field(u[i // 2], 8 * (i % 2) + 4 * g, 0xF), 8)
        scale[r, 0] = _half(wv[base])
        scale[r, 1] = scale[r, 0]

    return decode


def _decode_q5_0():
    """q4_0's runs (quant bytes at 6, word 3) with the fifth bits from the qh word (bytes 2-5, words 1-2): weight
    16g + 8t + i gains 16 * bit 16g + 8t + i."""
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        u = T.alloc_buffer((4,), "uint16", scope="local")
        for j in T.unroll(4):
            u[j] = wv[base + 3 + 4 * t + j]                        # quant bytes 8t + 2j, 2j + 1
        qh = T.bitwise_or(_u32(wv[base + 1]), T.shift_left(_u32(wv[base + 2]), T.uint32(16)))
        for g in T.unroll(2):
            for i in T.unroll(8):
                q[r, g * 8 + i] = _unsigned(T.bitwise_or(
                    _field(u[i // 2], 8 * (i % 2) + 4 * g, 0xF),
                    T.shift_left(_field(qh, 16 * g + 8 * t + i, 1), T.uint32(4))), 16)
        scale[r, 0] = _half(wv[base])
        scale[r, 1] = scale[r, 0]

    return decode


def _q4_k_scale_min(head, t, g, word: int, nibble: int):
    """ggml's get_scale_min_k4 for thread t's sub-block j = 2(t//2) + g: its scale (word 1, nibble 0) or its
    min (word 2, nibble 4). The 12 scale bytes are head[1..3]; byte j % 4 of each sits at shift 8 (j % 4).
    j < 4 (t < 4): 6 low bits of byte j (scale) / j + 4 (min); j >= 4: the low / high nibble of byte j + 4
    (head[3]) and, above it, the top 2 bits of byte j - 4 (scale) / j (min)."""
    sh = 8 * (2 * ((t // 2) % 2) + g)
    low = _field(head[word], sh, 63)
    high = T.bitwise_or(_field(head[3], sh + nibble, 0xF), T.shift_left(_field(head[word], sh + 6, 3), T.uint32(4)))
    return T.if_then_else(t < 4, low, high)


def _decode_q4_k():
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        head = T.alloc_buffer((4,), "uint32", scope="local")       # d | dmin << 16, then the 12 scale bytes
        qs = T.alloc_buffer((4,), "uint32", scope="local")         # quant bytes 32(t//2) + 16(t%2) .. + 16
        for v in T.vectorized(4):
            head[v] = wv[base + v]
        for v in T.vectorized(4):
            qs[v] = wv[base + 4 + 8 * (t // 2) + 4 * (t % 2) + v]
        for g in T.unroll(2):
            for i in T.unroll(16):
                q[r, g * 16 + i] = _unsigned(_field(qs[i // 4], 8 * (i % 4) + 4 * g, 0xF), 0)
        for g in T.unroll(2):
            scale[r, g] = _half(head[0]) * _unsigned(_q4_k_scale_min(head, t, g, 1, 0), 0)
            offset[r, g] = _half(T.shift_right(head[0], T.uint32(16))) * _unsigned(_q4_k_scale_min(head, t, g, 2, 4), 0)

    return decode


def _decode_q5_k():
    """q4_k's runs (176-byte blocks are 16-byte aligned too): thread t's quant bytes 32(t//2) + 16(t%2) .. + 16
    at byte 48, their fifth bits in qh bytes 16(t%2) .. + 16 at byte 16, bit 2(t//2) + g for nibble g."""
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        head = T.alloc_buffer((4,), "uint32", scope="local")       # d | dmin << 16, then the 12 scale bytes
        qh = T.alloc_buffer((4,), "uint32", scope="local")
        qs = T.alloc_buffer((4,), "uint32", scope="local")
        for v in T.vectorized(4):
            head[v] = wv[base + v]
        for v in T.vectorized(4):
            qh[v] = wv[base + 4 + 4 * (t % 2) + v]
        for v in T.vectorized(4):
            qs[v] = wv[base + 12 + 8 * (t // 2) + 4 * (t % 2) + v]
        for g in T.unroll(2):
            for i in T.unroll(16):
                q[r, g * 16 + i] = _unsigned(T.bitwise_or(
                    _field(qs[i // 4], 8 * (i % 4) + 4 * g, 0xF),
                    T.shift_left(_field(qh[i // 4], 8 * (i % 4) + g + 2 * (t // 2), 1), T.uint32(4))), 0)
        for g in T.unroll(2):
            scale[r, g] = _half(head[0]) * _unsigned(_q4_k_scale_min(head, t, g, 1, 0), 0)
            offset[r, g] = _half(T.shift_right(head[0], T.uint32(16))) * _unsigned(_q4_k_scale_min(head, t, g, 2, 4), 0)

    return decode


def _decode_q3_k():
    """q6_k's runs (110-byte blocks are 2-byte aligned): thread t's weights 128h + 32g + l0 .. + 8 (h = t // 4,
    l0 = 8(t%4)) are bits 2g of qs bytes 32h + l0 .. + 8 (at byte 32) and bit 4h + g of hmask bytes l0 .. + 8;
    run g lies in sub-block j = 8h + 2g + (t%4)//2, whose 6-bit scale is nibble h of byte j % 8 (byte 2g + p,
    p = (t%4)//2) with bits 2(j // 4) of byte 8 + j % 4 above it (scale bytes at 96, d at 108)."""
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        qs = T.alloc_buffer((4,), "uint16", scope="local")
        hm = T.alloc_buffer((4,), "uint16", scope="local")
        sc = T.alloc_buffer((6,), "uint16", scope="local")
        for j in T.unroll(4):
            qs[j] = wv[base + 16 + 16 * (t // 4) + 4 * (t % 4) + j]
        for j in T.unroll(4):
            hm[j] = wv[base + 4 * (t % 4) + j]
        for j in T.unroll(6):
            sc[j] = wv[base + 48 + j]
        for g in T.unroll(4):
            for i in T.unroll(8):
                q[r, g * 8 + i] = _unsigned(T.bitwise_or(
                    _field(qs[i // 2], 8 * (i % 2) + 2 * g, 3),
                    T.shift_left(_field(hm[i // 2], 8 * (i % 2) + g + 4 * (t // 4), 1), T.uint32(2))), 4)
            p8 = 8 * ((t % 4) // 2)
            six = T.bitwise_or(_field(sc[g], p8 + 4 * (t // 4), 0xF),
                               T.shift_left(_field(sc[4 + g % 2], p8 + 4 * (t // 4) + 2 * (g // 2), 3), T.uint32(4)))
            scale[r, g] = _half(wv[base + 54]) * _unsigned(six, 32)

    return decode


def _decode_q6_k():
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        ql = T.alloc_buffer((8,), "uint16", scope="local")     # ql bytes 64h + l0 .. +8, then 64h + 32 + l0 .. +8
        qh = T.alloc_buffer((4,), "uint16", scope="local")     # qh bytes 32h + l0 .. +8
        sc = T.alloc_buffer((4,), "uint16", scope="local")     # scale pairs 8h + 2c, + 1 for c = 0..3
        for s in T.unroll(2):
            for j in T.unroll(4):
                ql[s * 4 + j] = wv[base + 32 * (t // 4) + 16 * s + 4 * (t % 4) + j]
        for j in T.unroll(4):
            qh[j] = wv[base + 64 + 16 * (t // 4) + 4 * (t % 4) + j]
        for c in T.unroll(4):
            sc[c] = wv[base + 96 + 4 * (t // 4) + c]
        for c in T.unroll(4):
            for i in T.unroll(8):
                q[r, c * 8 + i] = _unsigned(T.bitwise_or(
                    _field(ql[(c % 2) * 4 + i // 2], 8 * (i % 2) + 4 * (c // 2), 0xF),
                    T.shift_left(_field(qh[i // 2], 8 * (i % 2) + 2 * c, 3), T.uint32(4))), 32)
            # positions l0 = 8(t%4) < 16 use the first scale of the pair, l0 >= 16 the second
            scale[r, c] = _half(wv[base + 104]) * _signed_byte(_field(sc[c], 8 * ((t % 4) // 2), 0xFF))

    return decode


# ggml's kvalues_iq4nl as int8 bytes, four to a uint32 word (little-endian): value q is byte q % 4 of word q // 4.
_IQ4_WORDS = (3215825025, 4142587343, 639175937, 1901675829)


def _iq4_value(nibble):
    """float(kvalues_iq4nl[nibble]) for a uint32 nibble: its table word picked by two compares, then its byte."""
    word = T.if_then_else(nibble < T.uint32(8),
                          T.if_then_else(nibble < T.uint32(4), T.uint32(_IQ4_WORDS[0]), T.uint32(_IQ4_WORDS[1])),
                          T.if_then_else(nibble < T.uint32(12), T.uint32(_IQ4_WORDS[2]), T.uint32(_IQ4_WORDS[3])))
    return _signed_byte(_field(word, T.shift_left(T.bitwise_and(nibble, T.uint32(3)), T.uint32(3)), 0xFF))


def _decode_iq4_xs():
    """Thread t owns sub-block t (136-byte blocks are 8-byte aligned: uint32 words, 8-byte loads): its 16 quant
    bytes at byte 8 + 16t (words 2 + 4t ..), low nibbles run 0, high run 1, values from the non-linear table; its
    scale d * (ls_t - 32), ls_t = nibble t of word 1 (scales_l) | bits 2t of scales_h (word 0's high half) << 4."""
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        head = T.alloc_buffer((2,), "uint32", scope="local")       # d | scales_h << 16, scales_l[0..3]
        qs = T.alloc_buffer((4,), "uint32", scope="local")
        for v in T.vectorized(2):
            head[v] = wv[base + v]
        for h in T.unroll(2):
            for v in T.vectorized(2):
                qs[2 * h + v] = wv[base + 2 + 4 * t + 2 * h + v]
        for g in T.unroll(2):
            for i in T.unroll(16):
                q[r, g * 16 + i] = _iq4_value(_field(qs[i // 4], 8 * (i % 4) + 4 * g, 0xF))
        six = T.bitwise_or(_field(head[1], 4 * t, 0xF), T.shift_left(_field(head[0], 16 + 2 * t, 3), T.uint32(4)))
        scale[r, 0] = _half(head[0]) * _unsigned(six, 32)
        scale[r, 1] = scale[r, 0]

    return decode


# e2m1's magnitudes doubled (kvalues_mxfp4[0..7]: 0, 1, 2, 3, 4, 6, 8, 12), nibble i of the word holding value i.
_MXFP4_MAGNITUDES = 0xC8643210


def _mxfp4_value(nibble):
    """float(kvalues_mxfp4[nibble]) for a uint32 nibble: the magnitude of its low 3 bits from the packed word, bit 3
    the sign (0 - magnitude: nibble 8 is +0, as the table's 0)."""
    magnitude = _unsigned(_field(T.uint32(_MXFP4_MAGNITUDES), T.shift_left(T.bitwise_and(nibble, T.uint32(7)),
                                                                            T.uint32(2)), 0xF), 0)
    return T.if_then_else(nibble < T.uint32(8), magnitude, T.float32(0) - magnitude)


def _e8m0_half(e):
    """ggml_e8m0_to_fp32_half of a uint32 byte: 2^(e - 128), the float of exponent field e - 1, or for e < 2 the
    subnormals 2^-128, 2^-127."""
    return T.reinterpret(_F32, T.if_then_else(e < T.uint32(2), T.shift_left(T.uint32(0x00200000), e),
                                              T.shift_left(e - T.uint32(1), T.uint32(23))))


def _decode_mxfp4():
    """q4_0's runs over 17-byte blocks (byte loads): thread t's quant bytes 8t .. + 8 at byte 1, low nibbles run 0
    (weights 8t + i), high run 1 (16 + 8t + i); the block's scale from its e8m0 byte 0."""
    @T.macro
    def decode(wv, base, t, q, scale, offset, r):
        u = T.alloc_buffer((8,), "uint8", scope="local")
        for j in T.unroll(8):
            u[j] = wv[base + 1 + 8 * t + j]
        for g in T.unroll(2):
            for i in T.unroll(8):
                q[r, g * 8 + i] = _mxfp4_value(_field(u[i], 4 * g, 0xF))
        scale[r, 0] = _e8m0_half(_u32(wv[base]))
        scale[r, 1] = scale[r, 0]

    return decode


_DECODERS = {"q8_0": _decode_q8_0, "q4_0": _decode_q4_0, "q5_0": _decode_q5_0, "q3_k": _decode_q3_k, "q4_k": _decode_q4_k,
             "q5_k": _decode_q5_k, "q6_k": _decode_q6_k, "iq4_xs": _decode_iq4_xs, "mxfp4": _decode_mxfp4}


def _view_width(fmt: _Format) -> int:
    return {"uint32": 4, "uint16": 2, "uint8": 1}[fmt.word]


# ------------------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------------------
def gemv_parts(qtype: str, n: int, k: int, rows_per_warp: int = ROWS_PER_WARP, warps: int = WARPS,
               unroll: int = UNROLL, m: int = 1, span: int = 1, store=None):
    """The GEMV's CTA body and launch geometry, for make_gpu_gemv_quant's PrimFunc and for kernels that pick their
    weights at run time (moe_experts_biased.py): (kernel_body(x, wvs, y, bx, ty, tx, aux), grid (CTAs along
    blockIdx.x), row_words (words per weight row), word type, row bytes).

    span: weights per output row (1, or 2: gate and up, each row of both decoded per step); wvs their `word` views
    [n * row_words]. store(y, aux, acc, tok, r, col): the epilogue writing output col of x's row tok from the lane's
    sums acc[tok, s * rows + r] (weight s), by the lane that owns them; aux is passed through (the caller's extra
    buffers). Default: y[tok, col] = fp16(acc[tok, r]), the plain GEMV's."""
    fmt = _check(qtype, n, k)
    if rows_per_warp < 1 or unroll < 1 or not 1 <= warps <= 1024 // WARP or m < 1 or span not in (1, 2):
        raise HelmcError(f"GPU GEMV: rows_per_warp >= 1, unroll >= 1, 1 <= warps <= 32, m >= 1, span 1 or 2 "
                         f"expected, found {rows_per_warp}, {unroll}, {warps}, m={m}, span={span}")
    blocks = k // fmt.weights
    row_bytes = blocks * fmt.bytes
    tpb, groups, run, ept, weights = fmt.threads, fmt.groups, fmt.run, fmt.per_thread, fmt.weights
    per_step = WARP // tpb                          # blocks of a row one warp covers per step
    outer = -(-blocks // (per_step * unroll))       # lanes past the row end in the last steps skip them
    rows, width = rows_per_warp, _view_width(fmt)
    lanes = rows * span                             # a lane's accumulator rows: weight 0's, then weight 1's
    row_words, block_words = row_bytes // width, fmt.bytes // width
    grid = -(-n // (rows * warps))
    has_offset = qtype in AFFINE
    decode = _DECODERS[qtype]()

    if store is None:
        @T.macro
        def store(y, aux, acc, tok, r, col):
            y[tok, col] = T.Cast("float16", acc[tok, r])

    @T.macro
    def block_step(x, wvs, acc, first_row, block, t, xh, xf, xsum, q, scale, offset, part):
        """acc[tok, r] += row (first_row + r)'s block `block` . x[tok], the runs of thread t, for every row of the
        group and every row tok of x: the group's quants first, then x's runs row by row (each read once)."""
        for r in T.unroll(rows):
            decode(wvs[0], T.min(first_row + r, n - 1) * row_words + block * block_words, t, q, scale, offset, r)
        if span == 2:
            for r in T.unroll(rows):
                decode(wvs[1], T.min(first_row + r, n - 1) * row_words + block * block_words, t, q, scale, offset,
                       rows + r)
        for tok in T.unroll(m):
            for g in T.unroll(groups):
                for v8 in T.unroll(run // 8):
                    for v in T.vectorized(8):
                        xh[g * run + v8 * 8 + v] = x[tok, block * weights + _run_start(qtype, t, g) + v8 * 8 + v]
            for e in T.unroll(ept):
                xf[e] = T.Cast(_F32, xh[e])
            if has_offset:
                for g in T.unroll(groups):
                    xsum[g] = T.float32(0)
                    for i in T.unroll(run):
                        xsum[g] = xsum[g] + xf[g * run + i]
            for r in T.unroll(lanes):
                for g in T.unroll(groups):
                    part[0] = T.float32(0)
                    for i in T.unroll(run):
                        part[0] = part[0] + xf[g * run + i] * q[r, g * run + i]
                    if has_offset:
                        acc[tok, r] = acc[tok, r] + (scale[r, g] * part[0] - offset[r, g] * xsum[g])
                    else:
                        acc[tok, r] = acc[tok, r] + scale[r, g] * part[0]

    @T.macro
    def kernel_body(x, wvs, y, bx, ty, tx, aux):
        acc = T.alloc_buffer((m, lanes), _F32, scope="local")
        xh = T.alloc_buffer((ept,), "float16", scope="local")
        xf = T.alloc_buffer((ept,), _F32, scope="local")
        xsum = T.alloc_buffer((groups,), _F32, scope="local")
        q = T.alloc_buffer((lanes, ept), _F32, scope="local")
        scale = T.alloc_buffer((lanes, groups), _F32, scope="local")
        offset = T.alloc_buffer((lanes, groups), _F32, scope="local")
        part = T.alloc_buffer((1,), _F32, scope="local")
        for tok in T.unroll(m):
            for r in T.unroll(lanes):
                acc[tok, r] = T.float32(0)
        for so in T.serial(outer):
            for si in T.unroll(unroll):
                if (so * unroll + si) * per_step + tx // tpb < blocks:
                    block_step(x, wvs, acc, (bx * warps + ty) * rows, (so * unroll + si) * per_step + tx // tpb,
                               tx % tpb, xh, xf, xsum, q, scale, offset, part)
        for tok in T.unroll(m):
            for r in T.unroll(rows):
                for w in T.unroll(span):
                    for s in T.unroll(5):         # butterfly: every lane ends with the warp's sum
                        acc[tok, w * rows + r] = acc[tok, w * rows + r] + T.tvm_warp_shuffle_xor(
                            T.uint32(0xFFFFFFFF), acc[tok, w * rows + r], 16 >> s, WARP, WARP)
                if tx == (tok * rows + r) % WARP and (bx * warps + ty) * rows + r < n:
                    store(y, aux, acc, tok, r, (bx * warps + ty) * rows + r)

    return kernel_body, grid, row_words, fmt.word, row_bytes


def make_gpu_gemv_quant(qtype: str, n: int, k: int, rows_per_warp: int = ROWS_PER_WARP,
                        warps: int = WARPS, unroll: int = UNROLL, m: int = 1) -> tirx.PrimFunc:
    """PrimFunc(x: float16[m, k], w: uint8[n, row_bytes], y: float16[m, n]) with y = x @ dequant(w)^T (fp32 sums).

    qtype: "q8_0" | "q4_0" | "q5_0" | "q3_k" | "q4_k" | "q5_k" | "q6_k" | "iq4_xs" | "mxfp4"; k must be a multiple of
    the type's block (HelmcError otherwise).
    rows_per_warp / warps / unroll: the row group of one warp, the warps of one thread block and the steps
    along k unrolled together (for tuning; defaults ROWS_PER_WARP, WARPS, UNROLL).
    m: rows of x (a batched decode step's sequences). Each block's quants are decoded once per thread and used
    for all m rows; row t's sums are formed as the m = 1 kernel forms them (the same lanes, runs, scale FMAs and
    butterfly, whatever m and the tuning), so y[t] is bit-identical to a 1-row call on x[t] alone.
    x, w and y must be 16-byte aligned (TVM and CuPy allocations are).
    """
    body, grid, row_words, word, row_bytes = gemv_parts(qtype, n, k, rows_per_warp, warps, unroll, m)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float16"), w: T.Buffer((n, row_bytes), "uint8"), y: T.Buffer((m, n), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        wv = T.decl_buffer((n * row_words,), word, data=w.data)       # [n * row_bytes / width]
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    body(x, [wv], y, bx, ty, tx, None)

    return gemv.with_attr("global_symbol", gemv_symbol(qtype, n, k, rows_per_warp, warps, unroll, m))


def make_gpu_dequantize(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    """PrimFunc(w: uint8[n, row_bytes], out: float16[n, k]) with out = the weights the blocks encode."""
    fmt = _check(qtype, n, k)
    blocks = k // fmt.weights
    row_bytes = blocks * fmt.bytes
    tpb, groups, run, ept = fmt.threads, fmt.groups, fmt.run, fmt.per_thread
    width = _view_width(fmt)
    row_words, block_words = row_bytes // width, fmt.bytes // width
    units = n * blocks * tpb                        # one thread per (row, block, t)
    grid = -(-units // DEQUANT_THREADS)
    has_offset = qtype in AFFINE
    decode = _DECODERS[qtype]()

    @T.prim_func
    def dequantize(w: T.Buffer((n, row_bytes), "uint8"), out: T.Buffer((n, k), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        wv = T.decl_buffer((n * row_words,), fmt.word, data=w.data)       # [n * row_bytes / width]
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for tx in T.thread_binding(DEQUANT_THREADS, thread="threadIdx.x"):
                q = T.alloc_buffer((1, ept), _F32, scope="local")
                scale = T.alloc_buffer((1, groups), _F32, scope="local")
                offset = T.alloc_buffer((1, groups), _F32, scope="local")
                oh = T.alloc_buffer((ept,), "float16", scope="local")
                if bx * DEQUANT_THREADS + tx < units:
                    # unit u = (row * blocks + block) * tpb + t
                    decode(wv, (bx * DEQUANT_THREADS + tx) // tpb * block_words, (bx * DEQUANT_THREADS + tx) % tpb,
                           q, scale, offset, 0)
                    for g in T.unroll(groups):
                        for i in T.unroll(run):
                            if has_offset:
                                oh[g * run + i] = T.Cast("float16", scale[0, g] * q[0, g * run + i] - offset[0, g])
                            else:
                                oh[g * run + i] = T.Cast("float16", scale[0, g] * q[0, g * run + i])
                    for g in T.unroll(groups):
                        for v8 in T.unroll(run // 8):
                            for v in T.vectorized(8):
                                out[(bx * DEQUANT_THREADS + tx) // (tpb * blocks),
                                    (bx * DEQUANT_THREADS + tx) // tpb % blocks * fmt.weights
                                    + _run_start(qtype, (bx * DEQUANT_THREADS + tx) % tpb, g) + v8 * 8 + v] = \
                                    oh[g * run + v8 * 8 + v]

    return dequantize.with_attr("global_symbol", dequantize_symbol(qtype, n, k))
