"""llama.cpp's block quantization formats (GGUF): Q8_0, Q4_0, Q5_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4, plus the
plain F16 / BF16 / F32.

A quantized row of k weights is k / block_weights blocks of block_bytes each, laid out exactly as ggml's
block structs (ggml-common.h), so `gguf.quants.dequantize` (the reference the tests compare against) and
llama.cpp read what `quantize` writes:

    q8_0 (34 B / 32 w):  d fp16, 32 x int8                                  w = d * q
    q4_0 (18 B / 32 w):  d fp16, 16 B of nibbles (w[i] low, w[i+16] high)  w = d * (q - 8)
    q5_0 (22 B / 32 w):  d fp16, qh[4] (bit i of the little-endian word: bit 4 of weight i), 16 B of nibbles as q4_0's
                         w = d * (q - 16)
    q3_k (110 B / 256 w): hmask[32] (bit j of byte l: bit 2 of weight 32j + l), 64 B of 2-bit fields (byte 32h + l,
                          bits 2c: weight 128h + 32c + l), 12 B of 6-bit scales for 16 sub-blocks of 16, d fp16
                          w = d * (sc_j - 32) * (q - 4), q in [0, 7]
    q4_k (144 B / 256 w): d fp16, dmin fp16, 12 B of 6-bit (scale, min) for 8 sub-blocks of 32, 128 B nibbles
                          w = d * sc_j * q - dmin * m_j
    q5_k (176 B / 256 w): q4_k's 16-byte header, 32 B qh (bit j of byte l: bit 4 of weight l of sub-block j),
                          128 B low nibbles as q4_k's;  w = d * sc_j * q - dmin * m_j, q in [0, 31]
    q6_k (210 B / 256 w): 128 B low nibbles, 64 B high 2 bits, 16 x int8 scales (sub-blocks of 16), d fp16
                          w = d * sc_j * (q - 32)
    iq4_xs (136 B / 256 w): d fp16, scales_h uint16 (bits 2j: the top 2 bits of sub-block j's scale), scales_l[4]
                          (nibble j % 2 of byte j // 2: its low 4), 128 B nibbles (sub-block j of 32: bytes 16j..16j+16,
                          weight i low, i + 16 high);  w = d * (ls_j - 32) * kvalues[q], kvalues = ggml's
                          kvalues_iq4nl (-127 .. 113, non-linear)
    mxfp4 (17 B / 32 w):  e uint8 (e8m0), 16 B of nibbles (w[i] low, w[i+16] high)
                          w = kvalues_mxfp4[q] * 2^(e - 128): kvalues_mxfp4 is e2m1 doubled (0, 1, 2, 3, 4, 6, 8, 12,
                          bit 3 the sign), so the scale is e8m0's 2^(e - 127) halved (ggml_e8m0_to_fp32_half;
                          e < 2 the subnormals 2^-128, 2^-127)

Q8_0, Q4_0, Q5_0 and MXFP4 use gguf's own NumPy quantizers (bit-exact with ggml's reference; MXFP4's byte-identical
to quantize_row_mxfp4_ref of llama.cpp 0c1e570, gcc -O2 -ffp-contract=off, on the golden rows, three seeds of the
structured rows, 64 x 4096 Gaussian, Laplace, integer, quarter-integer (ties), 1e-6-scale and all-zero rows and on
blocks whose largest |w| is a power of two, one ulp below or above it, from 2^-100 to 2^99; its dequantization
bit-identical to dequantize_row_mxfp4 on every scale byte). Q4_K and Q6_K are
written here (Q5_K and Q3_K too: gguf has no quantizer for them), following the algorithm of ggml's reference
quantizers (quantize_row_q4_K_ref / q5_K_ref with make_qkx2_quants; quantize_row_q6_K_ref with make_qx_quants;
quantize_row_q3_K_ref with make_q3_quants), which llama-quantize uses when no
importance matrix is given. They are vectorised over sub-blocks: an 8B model has ~25M Q4_K blocks, and a
Python loop per block would take hours. Arrays are laid out [elements of a sub-block, sub-blocks] so that
every sum over a sub-block's elements is NumPy's sequential reduction over the outer axis: the same float32
summation order as ggml's C loops, so the scales it searches for match ggml's to the last bit except where
ggml's build contracts a*b+c into an FMA (llama.cpp's native builds do).

IQ4_XS's quantizer is quant_iq4.py (gguf has none): ggml's quantize_row_iq4_xs_ref, byte-identical on the golden
rows, three seeds of the structured rows, 64 x 4096 Gaussian rows, integer, 1e-6-scale and all-zero rows (the
reference library built from llama.cpp's ggml-quants.c for the Q3_K check, called through ctypes). RMS error / RMS
0.0767 on 256 x 4096 Gaussian rows (q4_k 0.0713); ~0.9 M weights/s on one core (16 trial scales per sub-block),
so no `--quant` mix uses it: IQ4_XS comes from GGUF files.

Checked against ggml's reference quantizers compiled from llama.cpp 0c1e570 (ggml-quants.c, gcc -O2
-ffp-contract=off, called through ctypes): byte-identical on 100% of blocks for all four types, on Gaussian,
Laplace, outlier, negative-only, positive, constant, all-zero, 1e-6-scale, sparse and integer rows; against
a -O3 -march=native build (FMA contraction, as llama.cpp ships) 91-99% of q4_k / q6_k blocks are identical
and the RMS error differs by under 0.5%; llama-quantize --pure Q4_K_S of that build wrote Q4_K blocks identical
to these for every linear of a tiny Qwen3. Q5_K the same way (a later llama.cpp's quantize_row_q5_K_ref, gcc -O2
-ffp-contract=off): byte-identical on every block of the golden rows, of three seeds of the structured test rows
and of 64 x 4096 Gaussian rows. Q3_K the same way (quantize_row_q3_K_ref of 0c1e570, gcc -O2 -ffp-contract=off):
byte-identical on every block of the golden rows, three seeds of the structured rows, 64 x 4096 Gaussian rows,
integer rows and 1e-6-scale rows.
RMS error / RMS of the weights, 256 x 4096 rows, seed 0 (Gaussian | Laplace | Student-t 3):
    q8_0 0.0054 | 0.0067 | 0.0086        q4_0 0.0860 | 0.1069 | 0.1260
    q4_k 0.0713 | 0.0846 | 0.0912        fixed-scale baseline 0.0782 | 0.0918 | 0.0998
    q6_k 0.0177 | 0.0217 | 0.0254        fixed-scale baseline 0.0187 | 0.0223 | 0.0256
    q5_k 0.0361 (Gaussian)               fixed-scale baseline 0.0378 (/ 31 instead of / 15)
    q3_k 0.1509 | 0.1763 | 0.1871        fixed-scale baseline 0.1548 | 0.1786 | 0.1877
The baselines keep exact float32 scales (no 6-bit or fp16 rounding) but take them from the range without a
search: q4_k (max - min) / 15 from min per 32; q6_k (q3_k) the largest |x| at level -32 (-4) per 16.
Speed, one core: q4_k 10-16 M weights/s (its 21-step scale search), q6_k ~27 M/s, q3_k 5-10 M/s on a busy
2-core host (make_q3_quants' 5 passes of per-element descent, vectorised over sub-blocks), q8_0 / q4_0 ~250 M/s;
so an 8B model's ~7G linear weights take ~8-12 min to q4_k on one core, about 1/n of that on n cores.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants as gguf_quants

from helmc.errors import HelmcError
from helmc.model.weight_types import WEIGHT_TYPES

_EPS = np.float32(1e-15)      # ggml's GROUP_MAX_EPS: a group whose absmax is below it is all zeros
_CHUNK_WEIGHTS = 1 << 16      # weights per vectorised chunk: 256 KiB of float32 per temporary, cache-sized


@dataclass(frozen=True)
class QuantType:
    """A weight type's geometry with gguf's type enum (weight_types.WEIGHT_TYPES is the table)."""
    name: str                 # helmc's name: a weight_types.WEIGHT_TYPES key
    ggml_type: GGMLType
    block_weights: int        # weights per block (1 for the plain float types)
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_weights

    @property
    def is_block_quantized(self) -> bool:
        return self.block_weights > 1

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights; k must be a whole number of blocks."""
        return WEIGHT_TYPES[self.name].row_bytes(k)


QUANT_TYPES: dict[str, QuantType] = {t.name: QuantType(t.name, GGMLType(t.ggml_id), t.block_weights, t.block_bytes)
                                     for t in WEIGHT_TYPES.values()}


def quant_type(name: str) -> QuantType:
    if name not in QUANT_TYPES:
        raise HelmcError(f"quantization type expected one of {', '.join(QUANT_TYPES)}, found {name!r}")
    return QUANT_TYPES[name]


def quantize(w: np.ndarray, name: str, threads: int | None = None) -> np.ndarray:
    """uint8 [rows, row_bytes(k)] of the float32 weights w [rows, k] (a 1-D w is one row) in ggml's layout.

    k must be a multiple of the type's block size. Chunks of rows are independent, so `threads` (default:
    up to 8 cores) quantize them in parallel: NumPy releases the GIL inside each operation, and the result
    does not depend on the thread count."""
    qt = quant_type(name)
    w2 = np.asarray(w, dtype=np.float32)
    w2 = w2.reshape(1, -1) if w2.ndim == 1 else w2
    if w2.ndim != 2:
        raise HelmcError(f"quantize: expected a 2-D weight [rows, k], found shape {list(np.shape(w))}")
    rows, k = w2.shape
    if k % qt.block_weights:
        raise HelmcError(f"quantize: tensor of shape {list(w2.shape)}: its rows of {k} weights are not a multiple "
                         f"of the {qt.name} block size {qt.block_weights}")
    if not qt.is_block_quantized:
        # F32/F16 as NumPy casts them (round to nearest even), BF16 through gguf's rounding, as bytes.
        return gguf_quants.quantize(w2, qt.ggml_type).view(np.uint8).reshape(rows, qt.row_bytes(k))
    out = np.empty((rows, qt.row_bytes(k)), dtype=np.uint8)
    if rows == 0 or k == 0:
        return out
    step = max(1, _CHUNK_WEIGHTS // k)
    block_quantizer = WEIGHT_TYPES[name].maker("block_quantizer")
    spans = [(r, min(rows, r + step)) for r in range(0, rows, step)]

    def one(span):
        r0, r1 = span
        x = w2[r0:r1]
        if not np.isfinite(x).all():
            raise HelmcError(f"quantize: tensor of shape {list(w2.shape)} has a non-finite weight in rows [{r0}, {r1})")
        blocks = x.reshape(-1, qt.block_weights)           # [rows*k/bw, bw]: a row is a whole number of blocks
        out[r0:r1] = block_quantizer(blocks).reshape(r1 - r0, -1)

    n = threads if threads is not None else min(8, os.cpu_count() or 1)
    if n <= 1 or len(spans) == 1:
        for s in spans:
            one(s)
    else:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, spans))
    return out


def dequantize(raw: np.ndarray, name: str, shape) -> np.ndarray:
    """float32 weights of `shape` from the bytes `quantize` wrote (or the same data typed, as gguf's reader
    returns F16 / F32 tensors), through gguf's NumPy dequantizers."""
    qt = quant_type(name)
    shape = tuple(int(d) for d in shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    # The bytes of raw, whatever its dtype (gguf's reader hands out F16 / F32 data typed, blocks as uint8).
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(rows, qt.row_bytes(shape[-1]))
    if qt.name == "bf16":        # gguf's dequantize has no BF16 branch of its own for raw bytes of rows
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.asarray(gguf_quants.dequantize(data, qt.ggml_type), dtype=np.float32).reshape(shape)


# ---- Q8_0, Q4_0, Q5_0, MXFP4: gguf's quantizers -----------------------------------------------------------------

def _gguf_blocks(qtype: GGMLType):
    # The block quantizer itself: gguf.quants.quantize would split the chunk again into groups of 16 rows.
    return {GGMLType.Q8_0: gguf_quants.Q8_0, GGMLType.Q4_0: gguf_quants.Q4_0,
            GGMLType.Q5_0: gguf_quants.Q5_0, GGMLType.MXFP4: gguf_quants.MXFP4}[qtype].quantize_blocks


# ---- Q4_K --------------------------------------------------------------------------------------

def _rint(v: np.ndarray) -> np.ndarray:
    # ggml's nearest_int adds 1.5*2^23 in float32: round half to even, as np.rint does (|v| < 2^22).
    return np.rint(v)


def _affine_fit(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Per column (sub-block) of x [n, m]: levels L in [0, nmax] and (scale, min) with x ~ scale * L - min,
    minimising the w-weighted squared error; the search of ggml's make_qkx2_quants: start from the range,
    then try nstep + 1 scales (nmax + rmin + rdelta*i) / (max - min), each refit by weighted least squares.
    As in ggml, each try measures from the best min found so far, so the tries run in sequence (each one
    vectorised over all columns). Returns (scale [m], min [m] >= 0, L uint8 [n, m])."""
    f32 = np.float32
    mn = np.minimum(x.min(axis=0), f32(0))           # [m]: the min is never above 0 (the offset is subtracted)
    hi = x.max(axis=0)
    flat = hi == mn                                   # an all-equal (e.g. all-zero) sub-block: levels 0
    first_min = mn.copy()
    mn = np.where(flat, f32(-1), mn)                  # any span for the flat columns: their result is discarded
    sum_w = w.sum(axis=0)                             # sequential over the outer axis, as ggml's loop
    sum_x = (w * x).sum(axis=0)

    def levels(iscale, lo):
        return np.clip(_rint(iscale * (x - lo)), 0, nmax)

    iscale = f32(nmax) / (hi - mn)
    scale = f32(1) / iscale
    best_l = levels(iscale, mn)
    d = (scale * best_l + mn) - x
    best_err = (w * (d * d)).sum(axis=0)
    for i in range(nstep + 1):
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = (f32(rmin) + f32(rdelta) * f32(i) + f32(nmax)) / (hi - mn)
        la = levels(iscale, mn)
        wl = w * la
        sum_l = wl.sum(axis=0)
        sum_l2 = (wl * la).sum(axis=0)
        sum_xl = (wl * x).sum(axis=0)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det = np.where(ok, det, f32(1))
        s = (sum_w * sum_xl - sum_x * sum_l) / det
        m = (sum_l2 * sum_x - sum_l * sum_xl) / det
        pos = m > 0                                   # a positive offset: refit the scale with the min at 0
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(pos, sum_xl / sum_l2, s)
        m = np.where(pos, f32(0), m)
        d = (s * la + m) - x
        err = (w * (d * d)).sum(axis=0)
        better = ok & (err < best_err)
        best_l = np.where(better, la, best_l)
        best_err = np.where(better, err, best_err)
        scale = np.where(better, s, scale)
        mn = np.where(better, m, mn)
    scale = np.where(flat, f32(0), scale)
    mn = np.where(flat, first_min, mn)
    best_l = np.where(flat, f32(0), best_l)
    return scale.astype(f32), (-mn).astype(f32), best_l.astype(np.uint8)


def _k_affine_fit(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K's and Q5_K's shared fit of float32 blocks [nb, 256] (ggml's quantize_row_q4_K_ref / q5_K_ref differ
    only in the levels, nmax 15 | 31, and the search, rmin -1 | -0.5 over 21 | 16 scales): per sub-block of 32 a
    weighted affine fit, the 6-bit (scale, min) factors ls, lm [nb, 8] against the block's fp16 d, dmin [nb], and
    the levels L [32, nb*8] (element, sub-block) requantized against the scales as stored."""
    f32 = np.float32
    nb = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(nb * 8, 32).T)          # [32, nb*8]: element, sub-block
    av = np.sqrt((x * x).sum(axis=0) / f32(32))                     # [nb*8] RMS of each sub-block
    w = av + np.abs(x)                                               # ggml's weights: RMS + |x|
    scales, mins, L = _affine_fit(x, w, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)       # [nb, 8]
    # [nb]; a block's largest scale and min, never below +0 (ggml starts from 0 and keeps it on ties, -0.0 too)
    max_scale, max_min = np.maximum(scales.max(axis=1), f32(0)) + f32(0), np.maximum(mins.max(axis=1), f32(0)) + f32(0)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    # 6-bit scale and min of each sub-block relative to the block's d, dmin (scales never go below 0 here;
    # ggml would wrap a negative one through uint8, a case its least-squares fit does not produce).
    ls = np.clip(_rint(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)   # [nb, 8]
    lm = np.clip(_rint(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    d16 = (max_scale / f32(63)).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(np.float16)
    # Requantize every weight against the scales as stored (fp16 d times the 6-bit factor).
    dj = (d16.astype(f32)[:, None] * ls.astype(f32)).reshape(-1)      # [nb*8]
    dmj = (dmin16.astype(f32)[:, None] * lm.astype(f32)).reshape(-1)
    nz = dj != 0                                                       # ggml keeps the first fit's levels where d is 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_rint((x + dmj) / np.where(nz, dj, f32(1))), 0, nmax).astype(np.uint8)
    return ls, lm, d16, dmin16, np.where(nz, l2, L)


def _k_header(ls, lm, d16, dmin16) -> np.ndarray:
    """uint8 [nb, 16]: d, dmin and the 12 bytes of packed 6-bit (scale, min) pairs (ggml's get_scale_min_k4)."""
    nb = ls.shape[0]
    sc = np.empty((nb, 12), dtype=np.uint8)
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)                   # scales 0-3, high bits of scales 4-7
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)                   # mins 0-3, high bits of mins 4-7
    sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)         # low bits of scales / mins 4-7
    return np.concatenate([d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2), sc], axis=1)


def _q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [nb, 144] of float32 blocks [nb, 256]."""
    nb = blocks.shape[0]
    ls, lm, d16, dmin16, L = _k_affine_fit(blocks, 15, -1.0, 20)
    q = L.T.reshape(nb, 4, 2, 32)                                      # [nb, 64-weight group, half, 32]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([_k_header(ls, lm, d16, dmin16), qs], axis=1)


def _q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [nb, 176] of float32 blocks [nb, 256]: Q4_K's header, then qh[32] (bit j of byte l: the fifth bit
    of weight l of sub-block j), then the low nibbles as Q4_K's."""
    nb = blocks.shape[0]
    ls, lm, d16, dmin16, L = _k_affine_fit(blocks, 31, -0.5, 15)
    q = L.T.reshape(nb, 8, 32)                                         # [nb, sub-block, 32]
    qh = np.zeros((nb, 32), dtype=np.uint8)
    for j in range(8):
        qh |= (q[:, j] >> 4) << j
    low = (q & 0xF).reshape(nb, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([_k_header(ls, lm, d16, dmin16), qh, qs], axis=1)


# ---- Q6_K --------------------------------------------------------------------------------------

def _symmetric_fit(x: np.ndarray, nmax: int):
    """Per column of x [n, m]: a scale and signed levels l in [-nmax, nmax - 1] (returned as l + nmax),
    minimising the x^2-weighted squared error; ggml's make_qx_quants with rmse_type 1: the scale that maps
    the largest |x| to -nmax, then 18 nudged scales (nmax +- 0.1 i), each refit by least squares.
    Returns (scale [m], L uint8 [n, m])."""
    f32 = np.float32
    m = x.shape[1]
    idx = np.abs(x).argmax(axis=0)                    # the first largest |x|, as ggml's strict '>' keeps
    mx = x[idx, np.arange(m)]                         # [m], signed
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, f32(1), mx)
    w = x * x
    wx = w * x

    def fit(iscale):
        l = np.clip(_rint(iscale * x), -nmax, nmax - 1)
        return l, (wx * l).sum(axis=0), ((w * l) * l).sum(axis=0)

    l, sumlx, suml2 = fit(f32(-nmax) / mx)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
    best_l, best = l, scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        l, sumlx, suml2 = fit(-(f32(nmax) + f32(0.1) * f32(i)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = sumlx / suml2
        best_l = np.where(better, l, best_l)
        scale = np.where(better, s, scale)
        best = np.where(better, s * sumlx, best)
    scale = np.where(zero, f32(0), scale).astype(f32)
    L = np.where(zero, f32(0), best_l + f32(nmax)).astype(np.uint8)   # ggml leaves an all-zero group at 0
    return scale, L


def _q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [nb, 210] of float32 blocks [nb, 256]."""
    f32 = np.float32
    nb = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(nb * 16, 16).T)           # [16, nb*16]: element, sub-block
    scales, L = _symmetric_fit(x, 32)
    scales = scales.reshape(nb, 16)                                    # [nb, 16]
    pick = np.abs(scales).argmax(axis=1)                               # the sub-block of the largest |scale|
    max_scale = scales[np.arange(nb), pick]
    zero = np.abs(max_scale) < _EPS                                    # the whole block is zeros
    iscale = f32(-128) / np.where(zero, f32(1), max_scale)
    d16 = np.where(zero, f32(0), f32(1) / iscale).astype(np.float16)
    sc = np.minimum(_rint(iscale[:, None] * scales), 127).astype(np.int8)       # [nb, 16] in [-128, 127]
    sc[zero] = 0
    dj = (d16.astype(f32)[:, None] * sc.astype(f32)).reshape(-1)      # [nb*16]
    nz = dj != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = (np.clip(_rint(x / np.where(nz, dj, f32(1))), -32, 31) + 32).astype(np.uint8)
    L = np.where(nz, l2, L)
    L = np.where(np.repeat(zero, 16)[None, :], np.uint8(0), L)        # ggml zeroes an all-zero block's bytes
    q = L.T.reshape(nb, 2, 4, 32)                                      # [nb, 128-weight half, quarter, 32]
    ql = np.stack([q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4),
                   q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(nb, 2)], axis=1)


# ---- Q3_K --------------------------------------------------------------------------------------

def _q3_fit(x: np.ndarray):
    """Per column of x [16, m]: ggml's make_q3_quants(16, 4, do_rmse=true): levels from the scale that maps the
    largest |x| to -4, then up to 5 passes of per-element coordinate descent on the x^2-weighted fit (each
    element in turn moves to its best level if that improves sumlx^2 / suml2). The passes run over all
    columns at once; a column whose pass changed nothing would change nothing in the next, so running all
    five is ggml's early exit. Returns (scale [m], L int8 [16, m] in [0, 7])."""
    f32 = np.float32
    m = x.shape[1]
    idx = np.abs(x).argmax(axis=0)                    # the first largest |x| (ggml's strict '>')
    mx = x[idx, np.arange(m)]
    zero = np.abs(mx) < _EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = f32(-4) / np.where(zero, f32(1), mx)
    L = np.clip(_rint(iscale * x), -4, 3).astype(f32)   # [16, m]
    w = x * x
    wx = w * x
    sumlx, suml2 = np.zeros(m, f32), np.zeros(m, f32)
    for i in range(16):                               # ggml's sequential float sums
        sumlx = sumlx + wx[i] * L[i]
        suml2 = suml2 + (w[i] * L[i]) * L[i]
    for _ in range(5):
        for i in range(16):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - (w[i] * L[i]) * L[i]
            pos = slx > 0
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                new = np.clip(_rint((x[i] * sl2) / np.where(pos, slx, f32(1))), -4, 3).astype(f32)
            slx2 = slx + wx[i] * new
            sl22 = sl2 + (w[i] * new) * new
            take = pos & (new != L[i]) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = np.where(take, new, L[i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    scale = np.where(zero, f32(0), scale).astype(f32)
    L = np.where(zero[None, :], f32(0), L + f32(4)).astype(np.int8)   # ggml leaves an all-zero group at 0
    return scale, L


def _q3_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [nb, 110] of float32 blocks [nb, 256] (ggml's quantize_row_q3_K_ref): hmask[32] (bit j of byte l:
    the third bit of weight 32 j + l), qs[64] (2-bit levels: byte 32 h + l holds weights 128 h + 32 s + l at bits
    2 s), scales[12] (16 6-bit scales + 32: low nibbles in bytes 0-7, sub-block j < 8 low and j + 8 high; the
    top 2 bits of sub-block j at bits 2 (j // 4) of byte 8 + j % 4), d fp16;  w = d * (sc_j - 32) * (q - 4)."""
    f32 = np.float32
    nb = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(nb * 16, 16).T)           # [16, nb*16]: element, sub-block
    scales, L = _q3_fit(x)
    scales = scales.reshape(nb, 16)
    pick = np.abs(scales).argmax(axis=1)                               # the sub-block of the largest |scale|
    max_scale = scales[np.arange(nb), pick]
    zero = max_scale == 0
    with np.errstate(divide="ignore"):
        iscale = f32(-32) / np.where(zero, f32(1), max_scale)
    ls = (np.clip(_rint(iscale[:, None] * scales), -32, 31) + 32).astype(np.uint8)   # [nb, 16]
    ls[zero] = 0
    d16 = np.where(zero, f32(0), f32(1) / iscale).astype(np.float16)
    dj = (d16.astype(f32)[:, None] * (ls.astype(f32) - f32(32))).reshape(-1)         # [nb*16]
    nz = dj != 0                                                       # ggml keeps make_q3_quants' levels there
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = (np.clip(_rint(x / np.where(nz, dj, f32(1))), -4, 3) + 4).astype(np.int8)
    q = np.where(nz, l2, L).astype(np.uint8).T.reshape(nb, 256)       # [nb, weight]
    hm = (q >> 2).reshape(nb, 8, 32)                                   # [nb, bit, byte]
    hmask = np.zeros((nb, 32), dtype=np.uint8)
    for j in range(8):
        hmask |= hm[:, j] << j
    low = (q & 3).reshape(nb, 2, 4, 32)                                # [nb, 128-weight half, shift, byte]
    qs = (low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)).reshape(nb, 64)
    sc = np.zeros((nb, 12), dtype=np.uint8)
    sc[:, 0:8] = (ls[:, 0:8] & 0xF) | ((ls[:, 8:16] & 0xF) << 4)
    for j in range(16):
        sc[:, 8 + j % 4] |= (ls[:, j] >> 4) << (2 * (j // 4))
    return np.concatenate([hmask, qs, sc, d16.view(np.uint8).reshape(nb, 2)], axis=1)


# The block quantizers, by weight_types' references.
q8_0_blocks = _gguf_blocks(GGMLType.Q8_0)
q4_0_blocks = _gguf_blocks(GGMLType.Q4_0)
q5_0_blocks = _gguf_blocks(GGMLType.Q5_0)
mxfp4_blocks = _gguf_blocks(GGMLType.MXFP4)
q3_k_blocks = _q3_k_blocks
q4_k_blocks = _q4_k_blocks
q5_k_blocks = _q5_k_blocks
q6_k_blocks = _q6_k_blocks
