"""One decode token's routed experts of a mixture-of-experts block in one call: every selected expert's gate/up
GEMVs, SwiGLU and down GEMV, and their weighted sum, over the block's stacked expert weights (int8 path: Q4_K,
Q6_K, Q4_0, MXFP4: gpt-oss's experts).

Why: a token selects k experts per block (Qwen3-30B-A3B: 8 of 128), so calling the expert function once per
expert made 8 calls, 24 parallel regions and 8 host round trips of the activations per block; at 48 blocks the
calls' overhead outweighed reading the ~0.9 MB each expert weight holds. Here the activation is quantized once,
one parallel region runs every selected expert's gate and up rows (the same rows of both in one step, the one-expert
GEMV's step code, gemv_int8.one_token_step: each expert's gate and up bit-identical to that kernel's), the SwiGLU of
each expert is multiplied by its routing weight before its int8 quantization (per 256 values, so the weight only
moves the scale), and a second region forms each output row's dot product over every selected expert's blocks of
down in one set of accumulators, experts in the order of `sel` (the runtime passes them ascending): the weighted sum
is that dot product, and a row of K = I (a few blocks) pays its horizontal sums once, not once per expert.

The weights stay where the bundle binds them: each kind (gate, up, down) of a block is one uint8 tensor
[experts * rows, row_bytes], expert e's rows at e * rows (GGUF's `ffn_*_exps` layout), read through a view at that
offset.

  make_moe_expert_sum(gate_type, down_type, experts, inter, hidden, top_k, isa)
      -> PrimFunc(x: f32[1, H], sel: int32[n], weight: f32[n], w_gate: u8[E * I, gb], w_up: u8[E * I, gb],
                  w_down: u8[E * H, db], y: f32[1, H])        n <= top_k; y = sum_j weight[j] * expert_sel[j](x)
  make_moe_expert_sum(..., biased=BiasedExperts(alpha, limit)): gpt-oss's experts, the same kernel with the biases
      b_gate, b_up [E, I], b_down [E, H] (fp32) after w_down and the clamped SwiGLU,
      y = sum_j weight[j] * (expert_sel[j](x) + b_down[sel[j]])

The m-row kernel (moe_experts_rows.py) steps over the same blocks with the same macros (ExpertSumParts: the int8
quantizations, the gate/up GEMV step, one expert's down rows, the accumulators' sums; expert_activation: the
SwiGLU; for tiles of one expert's pairs gemv_int8's m-token row_dot, each token's sums formed as at one), so each of
its rows is this kernel's bits; only the loop nests differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import tirx
from tvm.script import tirx as T

from helmc.runtime.function_names import moe_expert_sum_name
from helmc.schedules.cpu.gemv_quant import quant_blocking
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.gemv_int8 import (INT8_TUNING, INT8_UNITS, Int8Unit, _const, _macros, _ramp,
                                                 int8_gemv_applies, one_token_step)
from helmc.schedules.cpu.quant.prefetch import prefetch_macro
from helmc.schedules.cpu.quant.tiles import _hsum
from helmc.schedules.cpu.weight_load import STACK


@dataclass(frozen=True)
class BiasedExperts:
    """gpt-oss's experts, what the kernels add to down(silu(gate) * up): each expert's gate, up and down biases
    (b_gate, b_up [E, I], b_down [E, H], fp32 arguments after the weights) and the clamped SwiGLU
    (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up clamped to +-limit."""
    alpha: float
    limit: float


def expert_activation(biased: BiasedExperts | None):
    """Macro (g, u, weight, expert, b_gate, b_up, row, col): u[row, col] = weight[row] * the SwiGLU of gate g and up u
    at [row, col]: silu(g) * u; with `biased`, expert expert[row]'s gate and up biases added first and BiasedExperts'
    clamped SwiGLU (without, b_gate and b_up are not read: the plain kernels pass None)."""
    if biased is None:
        @T.macro
        def swiglu(g, u, weight, expert, b_gate, b_up, row, col):
            u[row, col] = g[row, col] / (T.float32(1) + T.exp(-g[row, col])) * u[row, col] * weight[row]

        return swiglu
    alpha, limit = biased.alpha, biased.limit

    @T.macro
    def clamped_swiglu(g, u, weight, expert, b_gate, b_up, j, c):
        gv = T.meta_var(T.min(g[j, c] + b_gate[expert[j], c], T.float32(limit)))
        uv = T.meta_var(T.max(T.min(u[j, c] + b_up[expert[j], c], T.float32(limit)), T.float32(-limit)))
        u[j, c] = (uv + T.float32(1)) * (gv / (T.float32(1) + T.exp(gv * T.float32(-alpha)))) * weight[j]

    return clamped_swiglu


def moe_expert_sum_applies(gate_type: str, down_type: str, inter: int, hidden: int, isa: VectorIsa) -> bool:
    """The block's experts run through this kernel: gate/up and down of int8-path types (their GEMVs'
    one_token_step), on AVX-512."""
    return (gate_type is not None and down_type is not None and int8_gemv_applies(gate_type, isa, hidden)
            and int8_gemv_applies(down_type, isa, inter))


@dataclass(frozen=True)
class ExpertSumParts:
    """What the expert-sum kernels (one row here, m rows in moe_experts_rows.py) step over, and the macros of their
    steps, so each kernel is its loop nest only: gate/up's and down's int8 units (gate, down), the units along H
    and along I (g_blocks, d_blocks), the row bytes (gb, db), the parallel steps over I and over H (g_steps,
    d_steps, of d_rows rows each).

    Macros: quantize_x(x, xq, dx, xs, row, block) and quantize_a(a, aq, adx, axs, row, block), the int8 quantization
    of an activation's block; gate_step(w, w_int8, w_fp16, w_bytes, w_uint32, xq, dx, xs, y [1, I], step), the
    one-token GEMV's step (gemv_int8.one_token_step); clear(acc, accm), a down step's accumulators to 0;
    down_expert(w_down, expert, aq, adx, axs, a, acc, accm, step): step `step`'s d_rows rows of expert `expert`'s
    down against row a of the quantized activations, added to acc / accm; store(y, row, acc, accm, step): the
    accumulators' horizontal sums to y[row, the step's rows]."""
    gate: Int8Unit
    down: Int8Unit
    g_blocks: int
    d_blocks: int
    gb: int
    db: int
    d_rows: int
    g_steps: int
    d_steps: int
    quantize_x: Callable
    quantize_a: Callable
    gate_step: Callable
    clear: Callable
    down_expert: Callable
    store: Callable


def expert_sum_parts(gate_type: str, down_type: str, inter: int, hidden: int, isa: VectorIsa) -> ExpertSumParts:
    I, H = inter, hidden
    gu, dn = INT8_UNITS[gate_type], INT8_UNITS[down_type]
    g_blocks, d_blocks = H // gu.weights, I // dn.weights
    gb, db = g_blocks * gu.bytes, d_blocks * dn.bytes                     # row bytes of gate/up and of down
    g_rows, _ = quant_blocking(gate_type, 1, isa, INT8_TUNING[gate_type])
    d_rows, _ = quant_blocking(down_type, 1, isa, INT8_TUNING[down_type])
    quantize_x, _ = _macros(gate_type, isa, 1, 1)
    quantize_a, down_dot = _macros(down_type, isa, 1, 1)
    down_prefetch = prefetch_macro(d_rows, dn.bytes, db, INT8_TUNING[down_type], H)

    @T.macro
    def clear(acc, accm):
        for r in T.unroll(d_rows):
            acc[0, r, _ramp(0, 16)] = _const(0.0, "float32", 16)
            accm[0, r, _ramp(0, 8)] = _const(0.0, "float32", 8)

    @T.macro
    def down_expert(w_down, expert, aq, adx, axs, a, acc, accm, step):
        row0 = T.meta_var(expert * H)
        wd = T.decl_buffer((H, db), "uint8", data=w_down.data, elem_offset=row0 * db)
        wdi = T.decl_buffer((H, db), "int8", data=w_down.data, elem_offset=row0 * db)
        wdh = T.decl_buffer((H, db // 2), "float16", data=w_down.data, elem_offset=row0 * (db // 2))
        wdf = T.decl_buffer((H * db,), "uint8", data=w_down.data, elem_offset=row0 * db)
        wdu = T.decl_buffer((H, db // 4), "uint32", data=w_down.data, elem_offset=row0 * (db // 4))
        aqj = T.decl_buffer((1, I), "int8", data=aq.data, elem_offset=a * I)
        adxj = T.decl_buffer((1, d_blocks * dn.dx_lanes), "float32", data=adx.data,
                             elem_offset=a * (d_blocks * dn.dx_lanes))
        axsj = T.decl_buffer((1, d_blocks * dn.sums), dn.xs_dtype, data=axs.data, elem_offset=a * (d_blocks * dn.sums))
        for b in T.serial(d_blocks):
            down_prefetch(wdf, step * d_rows, b)
            for r in T.unroll(d_rows):
                down_dot(wd, wdi, wdh, wdu, aqj, adxj, axsj, acc, accm, T.min(step * d_rows + r, H - 1), r, b, 0)

    @T.macro
    def store(y, row, acc, accm, step):
        for r in T.unroll(d_rows):
            if step * d_rows + r < H:
                if dn.mins:
                    y[row, step * d_rows + r] = _hsum(acc[0, r, _ramp(0, 16)]) - _hsum(accm[0, r, _ramp(0, 8)])
                else:
                    y[row, step * d_rows + r] = _hsum(acc[0, r, _ramp(0, 16)])

    return ExpertSumParts(gu, dn, g_blocks, d_blocks, gb, db, d_rows, -(-I // g_rows), -(-H // d_rows), quantize_x,
                          quantize_a, one_token_step(gate_type, I, H, isa), clear, down_expert, store)


def make_moe_expert_sum(gate_type: str, down_type: str, experts: int, inter: int, hidden: int, top_k: int,
                        isa: VectorIsa, biased: BiasedExperts | None = None) -> tirx.PrimFunc:
    """`biased`: gpt-oss's experts (BiasedExperts), the plain kernel with the gate and up biases in its clamped
    SwiGLU and each selected expert's down bias, weighted, added after the dot products in the order of `sel`."""
    assert moe_expert_sum_applies(gate_type, down_type, inter, hidden, isa), (gate_type, down_type, inter, hidden)
    E, I, H, K = experts, inter, hidden, top_k
    k = expert_sum_parts(gate_type, down_type, inter, hidden, isa)
    gu, dn, g_blocks, d_blocks, gb, db, d_rows = k.gate, k.down, k.g_blocks, k.d_blocks, k.gb, k.db, k.d_rows
    activation = expert_activation(biased)

    @T.macro
    def moe_sum(x, sel_h, weight_h, w_gate, w_up, w_down, b_gate, b_up, b_down, y):
        n = T.int32()
        sel = T.match_buffer(sel_h, (n,), "int32")
        weight = T.match_buffer(weight_h, (n,), "float32")
        T.Assert(n <= K, "moe_expert_sum: more experts than the block's top-k")
        xq = T.alloc_buffer((1, H), "int8")
        dx = T.alloc_buffer((1, g_blocks * gu.dx_lanes), "float32")
        xs = T.alloc_buffer((1, g_blocks * gu.sums), gu.xs_dtype)
        g = T.alloc_buffer((K, I), "float32")                             # [k, I] each expert's gate(x)
        u = T.alloc_buffer((K, I), "float32")                             # [k, I] up(x), then weight * SwiGLU
        aq = T.alloc_buffer((K, I), "int8")
        adx = T.alloc_buffer((K, d_blocks * dn.dx_lanes), "float32")
        axs = T.alloc_buffer((K, d_blocks * dn.sums), dn.xs_dtype)
        for b in T.serial(g_blocks):
            k.quantize_x(x, xq, dx, xs, 0, b)
        for step in T.parallel(n * k.g_steps):
            j = step // k.g_steps
            row0 = sel[j] * I
            wg = T.decl_buffer((I, gb), "uint8", data=w_gate.data, elem_offset=row0 * gb)
            wgi = T.decl_buffer((I, gb), "int8", data=w_gate.data, elem_offset=row0 * gb)
            wgh = T.decl_buffer((I, gb // 2), "float16", data=w_gate.data, elem_offset=row0 * (gb // 2))
            wgf = T.decl_buffer((I * gb,), "uint8", data=w_gate.data, elem_offset=row0 * gb)
            wgu = T.decl_buffer((I, gb // 4), "uint32", data=w_gate.data, elem_offset=row0 * (gb // 4))
            wu = T.decl_buffer((I, gb), "uint8", data=w_up.data, elem_offset=row0 * gb)
            wui = T.decl_buffer((I, gb), "int8", data=w_up.data, elem_offset=row0 * gb)
            wuh = T.decl_buffer((I, gb // 2), "float16", data=w_up.data, elem_offset=row0 * (gb // 2))
            wuf = T.decl_buffer((I * gb,), "uint8", data=w_up.data, elem_offset=row0 * gb)
            wuu = T.decl_buffer((I, gb // 4), "uint32", data=w_up.data, elem_offset=row0 * (gb // 4))
            gj = T.decl_buffer((1, I), "float32", data=g.data, elem_offset=j * I)    # [1, I] row j of g
            uj = T.decl_buffer((1, I), "float32", data=u.data, elem_offset=j * I)
            k.gate_step(wg, wgi, wgh, wgf, wgu, xq, dx, xs, gj, step % k.g_steps)
            k.gate_step(wu, wui, wuh, wuf, wuu, xq, dx, xs, uj, step % k.g_steps)
        for jb in T.parallel(n * d_blocks):          # each expert's SwiGLU times its weight, quantized per block
            for i in T.serial(dn.weights):
                activation(g, u, weight, sel, b_gate, b_up, jb // d_blocks, jb % d_blocks * dn.weights + i)
            k.quantize_a(u, aq, adx, axs, jb // d_blocks, jb % d_blocks)
        # y[h] = sum_j down_j[h] . (weight_j a_j): one dot product over every expert's blocks per output row, summed
        # in the row's accumulators (one horizontal sum per row, where a row of K = I alone is only a few blocks)
        for step in T.parallel(k.d_steps):
            acc = T.alloc_buffer((1, d_rows, 16), "float32", scope="global", annotations=STACK)
            accm = T.alloc_buffer((1, d_rows, 8), "float32", scope="global", annotations=STACK)
            k.clear(acc, accm)
            for j in T.serial(n):
                k.down_expert(w_down, sel[j], aq, adx, axs, j, acc, accm, step)
            k.store(y, 0, acc, accm, step)
        if biased is not None:
            for h in T.parallel(H):                  # the down biases, weighted, in the experts' order
                for j in T.serial(n):
                    y[0, h] = y[0, h] + weight[j] * b_down[sel[j], h]

    if biased is None:
        @T.prim_func
        def moe_sum_plain(x: T.Buffer((1, H), "float32"), sel_h: T.handle, weight_h: T.handle,
                          w_gate: T.Buffer((E * I, gb), "uint8"), w_up: T.Buffer((E * I, gb), "uint8"),
                          w_down: T.Buffer((E * H, db), "uint8"), y: T.Buffer((1, H), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            moe_sum(x, sel_h, weight_h, w_gate, w_up, w_down, None, None, None, y)

        return moe_sum_plain.with_attr("global_symbol", moe_expert_sum_name(gate_type, down_type, E, I, H))

    @T.prim_func
    def moe_sum_biased(x: T.Buffer((1, H), "float32"), sel_h: T.handle, weight_h: T.handle,
                       w_gate: T.Buffer((E * I, gb), "uint8"), w_up: T.Buffer((E * I, gb), "uint8"),
                       w_down: T.Buffer((E * H, db), "uint8"), b_gate: T.Buffer((E, I), "float32"),
                       b_up: T.Buffer((E, I), "float32"), b_down: T.Buffer((E, H), "float32"),
                       y: T.Buffer((1, H), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        moe_sum(x, sel_h, weight_h, w_gate, w_up, w_down, b_gate, b_up, b_down, y)

    return moe_sum_biased.with_attr("global_symbol", moe_expert_sum_name(gate_type, down_type, E, I, H, biased=True))


