"""Prefill GEMM on Intel AMX (Sapphire Rapids and later) for bf16 and fp16 weights: y[t, n] = sum_k x[t, k] * W[n, k].

Why: on the GPU machine's 16-core Xeon, torch's bf16 CPU path runs a 128-token Qwen3-8B block in 8 ms on
AMX while the fp32-FMA GEMM (gemm.py) needs ~60 ms; a prompt's prefill through the CPU blocks is what
long contexts wait for. Selected only when the target's CPU features list amx_tile and amx_bf16.

Formulation: y^T = W . x^T, so W needs no repacking.
  A tile (16 weight rows x 32 k, bf16) is loaded straight from HF's row-major [N, K] weight (stride K * 2 B).
  B tile (32 k x 16 tokens) must be in AMX's pair-interleaved ("VNNI") layout: B[kp][2 t + e] = x[t][2 kp + e].
    The fp32 activations are packed into that layout once per call (a pass over tokens x K, small next to
    the weights), split as x = hi + lo with hi = bf16(x) and lo = bf16(x - hi): two products per tile give
    the activations ~16 mantissa bits, so the result matches an fp32 GEMM on bf16 weights to ~1e-5 instead
    of bf16 activations' ~3e-3 (the CPU stage's numerics test asks for 1e-3).
  C tile (16 weight rows x 16 tokens, fp32) accumulates over all of K in the tile register, then is stored
    transposed into y.
fp16 weights (these CPUs have bf16 tiles only): each task first splits its 32 x K panel into bf16 hi + lo
    (exact for every fp16 value) in a workspace it keeps in L2, and adds Whi.xhi + Whi.xlo + Wlo.xhi
    (the dropped Wlo.xlo is ~2^-16 of the result): 1.5x the tile products of bf16, still on AMX.
Register use: C 2x2 tiles (tmm0-3), A 2 tiles (tmm4-5), B 2 tiles (tmm6-7: hi, then lo, of 2 token blocks).
Parallel over blocks of 32 weight rows; each task keeps its 32 x K weight panel in L2 across token blocks.
Tokens are padded to a multiple of 32 with zero rows in the packed copy; stores skip the padding.

Linux gives AMX state only to processes that ask (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
the kernel asks on every call (idempotent, one syscall) and fails with a clear error if refused.

`emulate=True` builds the same loops with each tile instruction replaced by its definition in plain TIR
(tiles as stack arrays), so the packing, indexing and tails are tested on CPUs without AMX.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .isa import VectorIsa
from .weight_load import STACK

TILE_ROWS = 16          # rows of every tile
TILE_K = 32             # bf16 elements per A row (64 bytes)
PANEL_ROWS = 32         # weight rows per task: two A tiles
TOKEN_BLOCK = 32        # tokens per C column pair: two B tiles
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def amx_gemm_applies(n: int, k: int, weight_dtype: str, isa: VectorIsa) -> bool:
    """AMX for bf16 and fp16 weights in whole 32 x 32 tiles; anything else goes to gemm.py."""
    return (isa.has_amx_bf16 and weight_dtype in ("bfloat16", "float16")
            and n % PANEL_ROWS == 0 and k % TILE_K == 0)


def _to_bf16_bits(value):
    """Round-to-nearest-even fp32 -> bf16 bits (as uint16)."""
    bits = T.reinterpret("uint32", value)
    rounded = bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))
    return T.Cast("uint16", rounded >> T.uint32(16))


def _bf16_value(bits):
    return T.reinterpret("float32", T.shift_left(T.Cast("uint32", bits), T.uint32(16)))


def make_gemm_amx(n: int, k: int, weight_dtype: str = "bfloat16", emulate: bool = False) -> tirx.PrimFunc:
    assert n % PANEL_ROWS == 0 and k % TILE_K == 0, (n, k)
    assert weight_dtype in ("bfloat16", "float16"), weight_dtype
    fp16 = weight_dtype == "float16"
    a_parts = 2 if fp16 else 1        # fp16 weights: hi and lo bf16 halves (exact); bf16: the weight itself
    k_blocks = k // TILE_K
    tasks = n // PANEL_ROWS
    w_stride = T.int64(k * 2)
    load_dt = "float16" if fp16 else "uint16"
    # fp16: a workspace (512 KiB-1.5 MiB per task, too big for a stack); bf16 never touches it.
    panel_shape = (a_parts, 2, k_blocks, TILE_ROWS, TILE_K) if fp16 else (1,)
    panel_annotations = {} if fp16 else STACK

    @T.macro
    def tile_cfg(cfg):
        for i in T.serial(64):
            cfg[i] = T.uint8(0)
        cfg[0] = T.uint8(1)                         # palette 1
        for t in T.serial(8):
            cfg[16 + 2 * t] = T.uint8(64)           # bytes per row (little-endian uint16 low byte)
            cfg[48 + t] = T.uint8(TILE_ROWS)        # rows

    @T.prim_func
    def gemm(var_x: T.handle, w: T.Buffer((n, k), weight_dtype), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        tokens = T.int64()
        x = T.match_buffer(var_x, (tokens, k), "float32")
        y = T.match_buffer(var_y, (tokens, n), "float32")
        wl = T.decl_buffer((n, k), load_dt, data=w.data)
        # Packed activations: [16-token block][k block][kp 16][token 16][pair 2], each tile 1 KiB contiguous.
        xh = T.alloc_buffer((((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK) * 2, k_blocks, TILE_ROWS, 32), "uint16")
        xl = T.alloc_buffer((((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK) * 2, k_blocks, TILE_ROWS, 32), "uint16")
        if not emulate:
            granted = T.call_extern("int64", "syscall", T.int64(SYS_ARCH_PRCTL), T.int64(ARCH_REQ_XCOMP_PERM),
                                    T.int64(XFEATURE_XTILEDATA))
            assert granted == T.int64(0), "AMX GEMM: Linux refused AMX tile state (arch_prctl XTILEDATA)"
        for kb in T.parallel(k_blocks):
            for tb in T.serial(((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK) * 2):
                for kp in T.serial(TILE_ROWS):
                    for t in T.serial(16):
                        for e in T.unroll(2):
                            v = T.if_then_else(tb * 16 + t < tokens,
                                               x[T.min(tb * 16 + t, tokens - 1), kb * TILE_K + kp * 2 + e],
                                               T.float32(0))
                            hi = _to_bf16_bits(v)
                            xh[tb, kb, kp, t * 2 + e] = hi
                            xl[tb, kb, kp, t * 2 + e] = _to_bf16_bits(v - _bf16_value(hi))
        for task in T.parallel(tasks):
            cfg = T.alloc_buffer((64,), "uint8", scope="global", annotations=STACK)
            cst = T.alloc_buffer((4, TILE_ROWS, 16), "float32", scope="global", annotations=STACK)
            # fp16 only: this task's 32-row panel as [hi/lo][A tile][k block] 16 x 32 bf16 tiles (a workspace).
            panel = T.alloc_buffer(panel_shape, "uint16", annotations=panel_annotations)
            # Emulation only: the 8 tile registers as arrays.
            ta = T.alloc_buffer((8, TILE_ROWS, 32), "uint16", scope="global", annotations=STACK)
            tc = T.alloc_buffer((4, TILE_ROWS, 16), "float32", scope="global", annotations=STACK)
            if fp16:
                for a in T.serial(2):
                    for kb in T.serial(k_blocks):
                        for i in T.serial(TILE_ROWS):
                            # No let-bound temporary here: TVM 0.27's vectorizer got a let inside this loop wrong.
                            for c in T.vectorized(TILE_K):
                                panel[0, a, kb, i, c] = _to_bf16_bits(
                                    T.Cast("float32", wl[task * PANEL_ROWS + a * 16 + i, kb * TILE_K + c]))
                            for c in T.vectorized(TILE_K):
                                panel[a_parts - 1, a, kb, i, c] = _to_bf16_bits(
                                    T.Cast("float32", wl[task * PANEL_ROWS + a * 16 + i, kb * TILE_K + c])
                                    - _bf16_value(panel[0, a, kb, i, c]))
            if not emulate:
                tile_cfg(cfg)
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            for tb2 in T.serial((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK):
                if emulate:
                    for c in T.serial(4):
                        for i in T.serial(TILE_ROWS):
                            for j in T.serial(16):
                                tc[c, i, j] = T.float32(0)
                else:
                    for c in T.unroll(4):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.Cast("int8", c)))
                for kb in T.serial(k_blocks):
                    # Products: bf16 W.xhi + W.xlo; fp16 Whi.xhi + Whi.xlo + Wlo.xhi (Wlo.xlo is ~2^-16 of y).
                    for ap in T.unroll(a_parts):
                        if emulate:
                            for a in T.serial(2):
                                for i in T.serial(TILE_ROWS):
                                    for c in T.serial(32):
                                        if fp16:
                                            ta[4 + a, i, c] = panel[ap, a, kb, i, c]
                                        else:
                                            ta[4 + a, i, c] = wl[task * PANEL_ROWS + a * 16 + i, kb * TILE_K + c]
                        else:
                            for a in T.unroll(2):
                                if fp16:
                                    T.evaluate(T.call_llvm_intrin(
                                        "void", "llvm.x86.tileloadd64", T.Cast("int8", 4 + a),
                                        T.address_of(panel[ap, a, kb, 0, 0]), T.int64(64)))
                                else:
                                    T.evaluate(T.call_llvm_intrin(
                                        "void", "llvm.x86.tileloadd64", T.Cast("int8", 4 + a),
                                        T.address_of(wl[task * PANEL_ROWS + a * 16, kb * TILE_K]), w_stride))
                        for bp in T.unroll(2):        # 0: hi, 1: lo half of the activations
                            if ap + bp < 2:
                                if emulate:
                                    for b in T.serial(2):
                                        for i in T.serial(TILE_ROWS):
                                            for c in T.serial(32):
                                                ta[6 + b, i, c] = T.if_then_else(bp == 0, xh[tb2 * 2 + b, kb, i, c],
                                                                                 xl[tb2 * 2 + b, kb, i, c])
                                    for a in T.serial(2):
                                        for b in T.serial(2):
                                            for i in T.serial(TILE_ROWS):
                                                for j in T.serial(16):
                                                    for kp in T.serial(TILE_ROWS):
                                                        tc[a * 2 + b, i, j] = tc[a * 2 + b, i, j] + \
                                                            _bf16_value(ta[4 + a, i, 2 * kp]) * _bf16_value(ta[6 + b, kp, 2 * j]) + \
                                                            _bf16_value(ta[4 + a, i, 2 * kp + 1]) * _bf16_value(ta[6 + b, kp, 2 * j + 1])
                                else:
                                    for b in T.unroll(2):
                                        if bp == 0:
                                            T.evaluate(T.call_llvm_intrin(
                                                "void", "llvm.x86.tileloadd64", T.Cast("int8", 6 + b),
                                                T.address_of(xh[tb2 * 2 + b, kb, 0, 0]), T.int64(64)))
                                        else:
                                            T.evaluate(T.call_llvm_intrin(
                                                "void", "llvm.x86.tileloadd64", T.Cast("int8", 6 + b),
                                                T.address_of(xl[tb2 * 2 + b, kb, 0, 0]), T.int64(64)))
                                    for a in T.unroll(2):
                                        for b in T.unroll(2):
                                            T.evaluate(T.call_llvm_intrin(
                                                "void", "llvm.x86.tdpbf16ps", T.Cast("int8", a * 2 + b),
                                                T.Cast("int8", 4 + a), T.Cast("int8", 6 + b)))
                if emulate:
                    for c in T.serial(4):
                        for i in T.serial(TILE_ROWS):
                            for j in T.serial(16):
                                cst[c, i, j] = tc[c, i, j]
                else:
                    for c in T.unroll(4):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.Cast("int8", c),
                                                      T.address_of(cst[c, 0, 0]), T.int64(64)))
                for b in T.serial(2):
                    for j in T.serial(16):
                        if tb2 * TOKEN_BLOCK + b * 16 + j < tokens:
                            for a in T.serial(2):
                                for i in T.serial(TILE_ROWS):
                                    y[tb2 * TOKEN_BLOCK + b * 16 + j, task * PANEL_ROWS + a * 16 + i] = \
                                        cst[a * 2 + b, i, j]
            if not emulate:
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    short = "f16" if fp16 else "bf16"
    name = f"helmc_gemm_amx_{short}_n{n}_k{k}" + ("_emulated" if emulate else "")
    return gemm.with_attr("global_symbol", name)
