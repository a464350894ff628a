"""Prefill over llama.cpp's block formats (GGUF): dequantize the weight, then the fp16 GEMM (gemm.gemm_body).

make_gemm_quant(qtype, n, k, isa): y[m, n] = x[m, k] @ dequant(W)^T with W as the file stores it, uint8
[n, row_bytes]. Phase 1 dequantizes every row into a per-call fp16 scratch [n, k] (a workspace of the call,
freed after it; fp16 keeps the ~11 bits the block formats' products need to within ~5e-4), phase 2 is the fp16
prefill GEMM's own loop nest on it, so the prompt's GEMM runs at the fp16 kernel's speed plus one pass over the
weight. Decode never does this (gemv_quant dequantizes in registers). Each element follows ggml's
dequantize_row_* (ggml-quants.c), written once per type below; make_dequantize exposes phase 1 alone (tests).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.gemm import gemm_body
from helmc.schedules.cpu.gemv_quant import QUANT_BLOCKS, quant_row_bytes
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.mxfp4 import e8m0_half
from helmc.schedules.cpu.weight_load import load_dtype

_OUT_DTYPES = ("float16", "float32")


def _u(w, i):
    return T.Cast("int32", w[i])


def _half(wh, byte_offset):
    return T.Cast("float32", wh[byte_offset // 2])          # fp16 fields sit at even byte offsets


def _q8_0(w, wh, base, e):
    q = T.Cast("int32", T.Cast("int8", w[base + 2 + e]))
    return _half(wh, base) * T.Cast("float32", q)


def _q4_0(w, wh, base, e):
    byte = _u(w, base + 2 + e % 16)
    q = T.if_then_else(e < 16, T.bitwise_and(byte, 15), T.shift_right(byte, 4)) - 8
    return _half(wh, base) * T.Cast("float32", q)


def _q5_0(w, wh, base, e):
    byte = _u(w, base + 6 + e % 16)
    high = T.bitwise_and(T.shift_right(_u(w, base + 2 + e // 8), e % 8), 1)      # bit e of the qh word
    q = T.bitwise_or(T.if_then_else(e < 16, T.bitwise_and(byte, 15), T.shift_right(byte, 4)), T.shift_left(high, 4)) - 16
    return _half(wh, base) * T.Cast("float32", q)


def _q3_k(w, wh, base, e):
    h, c, lane, j = e // 128, (e % 128) // 32, e % 32, e // 16   # half, 2-bit field, position, sub-block
    low = T.bitwise_and(T.shift_right(_u(w, base + 32 + 32 * h + lane), 2 * c), 3)
    q = T.bitwise_or(low, T.shift_left(T.bitwise_and(T.shift_right(_u(w, base + lane), 4 * h + c), 1), 2)) - 4
    six = T.bitwise_or(T.bitwise_and(T.shift_right(_u(w, base + 96 + j % 8), 4 * (j // 8)), 15),
                       T.shift_left(T.bitwise_and(T.shift_right(_u(w, base + 104 + j % 4), 2 * (j // 4)), 3), 4))
    return _half(wh, base + 108) * T.Cast("float32", six - 32) * T.Cast("float32", q)


def _q4_k_scale_min(w, base, j):
    """ggml's get_scale_min_k4: 6-bit (scale, min) of sub-block j from the block's 12 scale bytes."""
    s = base + 4
    lo_sc = T.bitwise_and(_u(w, s + j % 4), 63)
    lo_m = T.bitwise_and(_u(w, s + j % 4 + 4), 63)
    hi_sc = T.bitwise_or(T.bitwise_and(_u(w, s + j % 4 + 8), 15), T.shift_left(T.shift_right(_u(w, s + j % 4), 6), 4))
    hi_m = T.bitwise_or(T.shift_right(_u(w, s + j % 4 + 8), 4), T.shift_left(T.shift_right(_u(w, s + j % 4 + 4), 6), 4))
    return T.if_then_else(j < 4, lo_sc, hi_sc), T.if_then_else(j < 4, lo_m, hi_m)


def _q4_k(w, wh, base, e):
    c, hi, lane = e // 64, (e % 64) // 32, e % 32      # 64-weight chunk, which nibble, position in the chunk
    sc, m = _q4_k_scale_min(w, base, 2 * c + hi)
    q = T.bitwise_and(T.shift_right(_u(w, base + 16 + 32 * c + lane), 4 * hi), 15)
    return _half(wh, base) * T.Cast("float32", sc) * T.Cast("float32", q) - _half(wh, base + 2) * T.Cast("float32", m)


def _q5_k(w, wh, base, e):
    c, hi, lane = e // 64, (e % 64) // 32, e % 32      # as q4_k's; the fifth bit is bit 2c + hi of qh[lane]
    sc, m = _q4_k_scale_min(w, base, 2 * c + hi)
    low = T.bitwise_and(T.shift_right(_u(w, base + 48 + 32 * c + lane), 4 * hi), 15)
    q = T.bitwise_or(low, T.shift_left(T.bitwise_and(T.shift_right(_u(w, base + 16 + lane), 2 * c + hi), 1), 4))
    return _half(wh, base) * T.Cast("float32", sc) * T.Cast("float32", q) - _half(wh, base + 2) * T.Cast("float32", m)


def _q6_k(w, wh, base, e):
    half, quarter, lane = e // 128, (e % 128) // 32, e % 32   # 128-weight half, which of its 4 quarters, position
    ql = _u(w, base + 64 * half + lane + 32 * (quarter % 2))
    low = T.bitwise_and(T.shift_right(ql, 4 * (quarter // 2)), 15)
    high = T.bitwise_and(T.shift_right(_u(w, base + 128 + 32 * half + lane), 2 * quarter), 3)
    q = T.bitwise_or(low, T.shift_left(high, 4)) - 32
    scale = T.Cast("int32", T.Cast("int8", w[base + 192 + 8 * half + lane // 16 + 2 * quarter]))
    return _half(wh, base + 208) * T.Cast("float32", scale) * T.Cast("float32", q)


# ggml's kvalues_iq4nl as int8 bytes, four to an int32 word (little-endian): value q is byte q % 4 of word q // 4.
_IQ4_WORDS = (-1079142271, -152379953, 639175937, 1901675829)


def _iq4_xs(w, wh, base, e):
    j, i = e // 32, e % 32                              # sub-block, position: byte 8 + 16j + i % 16, nibble i // 16
    byte = _u(w, base + 8 + 16 * j + i % 16)
    q = T.if_then_else(i < 16, T.bitwise_and(byte, 15), T.shift_right(byte, 4))
    word = T.if_then_else(q < 8, T.if_then_else(q < 4, _IQ4_WORDS[0], _IQ4_WORDS[1]),
                          T.if_then_else(q < 12, _IQ4_WORDS[2], _IQ4_WORDS[3]))
    value = T.Cast("int32", T.Cast("int8", T.shift_right(word, 8 * T.bitwise_and(q, 3))))
    low = T.bitwise_and(T.shift_right(_u(w, base + 4 + j // 2), 4 * (j % 2)), 15)
    high = T.bitwise_and(T.shift_right(_u(w, base + 2 + j // 4), 2 * (j % 4)), 3)
    scale = T.bitwise_or(low, T.shift_left(high, 4)) - 32
    return _half(wh, base) * T.Cast("float32", scale) * T.Cast("float32", value)


# ggml's kvalues_mxfp4 as int8 bytes, four to an int32 word (little-endian): value q is byte q % 4 of word q // 4.
_MXFP4_WORDS = (50462976, 201852420, -33620224, -185009412)


def _mxfp4(w, wh, base, e):
    byte = _u(w, base + 1 + e % 16)                     # 17-byte blocks: the e8m0 byte, then q4_0's nibbles
    q = T.if_then_else(e < 16, T.bitwise_and(byte, 15), T.shift_right(byte, 4))
    word = T.if_then_else(q < 8, T.if_then_else(q < 4, _MXFP4_WORDS[0], _MXFP4_WORDS[1]),
                          T.if_then_else(q < 12, _MXFP4_WORDS[2], _MXFP4_WORDS[3]))
    value = T.Cast("int32", T.Cast("int8", T.shift_right(word, 8 * T.bitwise_and(q, 3))))
    return e8m0_half(_u(w, base)) * T.Cast("float32", value)


_ELEMENT = {"q8_0": _q8_0, "q4_0": _q4_0, "q5_0": _q5_0, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
            "iq4_xs": _iq4_xs, "mxfp4": _mxfp4}


def _dequantize_rows(qtype: str, n: int, k: int, out_dtype: str):
    """Macro fill(w, out): every row of the blocks w (uint8 [n, row_bytes]) dequantized into out [n, k]."""
    row_bytes = quant_row_bytes(qtype, k)               # checks qtype and that k is whole blocks
    fmt = QUANT_BLOCKS[qtype]
    blocks, per_block, block_bytes = k // fmt.weights, fmt.weights, fmt.bytes
    element = _ELEMENT[qtype]

    @T.macro
    def fill(w, out):
        flat = T.decl_buffer((n * row_bytes,), "uint8", data=w.data)
        wh = T.decl_buffer((n * row_bytes // 2,), "float16", data=w.data)   # [n * row_bytes / 2]: fp16 fields
        for row in T.parallel(n):
            for b in T.serial(blocks):
                for e in T.serial(per_block):
                    out[row, b * per_block + e] = T.Cast(
                        out_dtype, element(flat, wh, row * row_bytes + b * block_bytes, e))

    return fill, row_bytes


def make_dequantize(qtype: str, n: int, k: int, out_dtype: str = "float16") -> tirx.PrimFunc:
    """PrimFunc(w: uint8[n, row_bytes], out: out_dtype[n, k]): phase 1 of make_gemm_quant alone."""
    from helmc.errors import HelmcError
    if out_dtype not in _OUT_DTYPES:
        raise HelmcError(f"dequantize: out dtype expected one of {_OUT_DTYPES}, found {out_dtype!r}")
    fill, row_bytes = _dequantize_rows(qtype, n, k, out_dtype)

    @T.prim_func
    def dequantize(w: T.Buffer((n, row_bytes), "uint8"), out: T.Buffer((n, k), out_dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        fill(w, out)

    return dequantize.with_attr("global_symbol", f"helmc_dequantize_{qtype}_n{n}_k{k}_{out_dtype}")


def make_gemm_quant(qtype: str, n: int, k: int, isa: VectorIsa) -> tirx.PrimFunc:
    """PrimFunc(x: float32[m, k], w: uint8[n, row_bytes], y: float32[m, n]) for any (symbolic) m."""
    fill, row_bytes = _dequantize_rows(qtype, n, k, "float16")
    body = gemm_body(n, k, "float16", isa)
    wdt = load_dtype("float16")

    @T.prim_func
    def gemm(var_x: T.handle, w: T.Buffer((n, row_bytes), "uint8"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        tokens = T.int64()
        x = T.match_buffer(var_x, (tokens, k), "float32")
        y = T.match_buffer(var_y, (tokens, n), "float32")
        scratch = T.alloc_buffer((n, k), "float16")
        fill(w, scratch)
        wl = T.decl_buffer((n, k), wdt, data=scratch.data)
        body(x, wl, y, tokens)

    return gemm.with_attr("global_symbol", f"helmc_gemm_{qtype}_n{n}_k{k}")
