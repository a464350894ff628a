"""One decode token's routed experts of a mixture-of-experts block on the GPU in two launches, over the block's
stacked expert weights in VRAM (Q3_K / Q4_K / Q5_K / Q6_K: the int8 decode GEMV's arithmetic, quant_gemv_int8.py).

Why: the GPU stage ran each selected expert as its own compiled expert function (8 of 128 per block for
Qwen3-30B-A3B), each a VM call with host-side bookkeeping between; and the experts to run had to be known on the
host. Here `sel` (the selected experts' slots in the stacked weights) is a device tensor the kernels read, so the
GPU never waits on the host to learn which experts a token chose.

  gate_up(x: f16[1, H], sel: i32[n], w_gate: u8[slots * I, gb], w_up: u8[slots * I, gb], a: f16[K, I])
      a[j] = silu(x @ gate_sel[j]^T) * (x @ up_sel[j]^T)   (the int8 GEMV's swiglu epilogue; blockIdx.y = j)
  down(a: f16[K, I], sel: i32[n], w_down: u8[slots * H, db], part: f16[K, H])
      part[j] = a[j] @ down_sel[j]^T                        (blockIdx.y = j)
The caller weights and sums part[:n] (fp32). Each CTA reads its expert's rows through a view at sel[j] * rows, so
expert j's result is the bits of the one-weight kernel on that expert.

A batched decode step's m rows take the same two launches over all their (row, expert) pairs (make_gpu_moe_rows_
kernels): pair j's CTAs read x's row row[j], so each pair's a and part are the bits the one-row kernels give that
row alone; CTAs of pairs sharing an expert read its weights through L2.
  gate_up_rows(x: f16[m, H], sel: i32[n], row: i32[n], w_gate, w_up, a: f16[n, I])
  down_rows(a: f16[n, I], sel: i32[n], w_down, part: f16[n, H])
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.runtime.function_names import gpu_moe_names, gpu_moe_rows_names
from helmc.schedules.gpu.quant_gemv_int8 import INT8_TYPES, WARP, WARPS, int8_kernel_parts


def gpu_moe_applies(gate_type: str, down_type: str, inter: int, hidden: int) -> bool:
    return gate_type in INT8_TYPES and down_type in INT8_TYPES and inter % 256 == 0 and hidden % 256 == 0


def make_gpu_moe_kernels(gate_type: str, down_type: str, experts: int, inter: int, hidden: int,
                         top_k: int) -> dict[str, tirx.PrimFunc]:
    """{global symbol: PrimFunc} of the gate_up and down kernels."""
    assert gpu_moe_applies(gate_type, down_type, inter, hidden), (gate_type, down_type, inter, hidden)
    E, I, H, K = experts, inter, hidden, top_k
    up_body, up_grid, g_words, g_word, gb, _ = int8_kernel_parts(gate_type, I, H, epilogue="swiglu")
    down_body, down_grid, d_words, d_word, db, _ = int8_kernel_parts(down_type, H, I)
    gate_up_name, down_name = gpu_moe_names(gate_type, down_type, E, I, H)

    @T.prim_func
    def gate_up(x: T.Buffer((1, H), "float16"), sel_h: T.handle, w_gate_h: T.handle, w_up_h: T.handle,
                a: T.Buffer((K, I), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n, slot_rows = T.int32(), T.int32()
        sel = T.match_buffer(sel_h, (n,), "int32")
        w_gate = T.match_buffer(w_gate_h, (slot_rows, gb), "uint8")          # [slots * I, gb]
        w_up = T.match_buffer(w_up_h, (slot_rows, gb), "uint8")
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(up_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        gv = T.decl_buffer((I * g_words,), g_word, data=w_gate.data, elem_offset=sel[j] * (I * g_words))
                        uv = T.decl_buffer((I * g_words,), g_word, data=w_up.data, elem_offset=sel[j] * (I * g_words))
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        up_body(x, [gv, uv], [aj], bx, ty, tx)

    @T.prim_func
    def down(a: T.Buffer((K, I), "float16"), sel_h: T.handle, w_down_h: T.handle,
             part: T.Buffer((K, H), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n, slot_rows = T.int32(), T.int32()
        sel = T.match_buffer(sel_h, (n,), "int32")
        w_down = T.match_buffer(w_down_h, (slot_rows, db), "uint8")          # [slots * H, db]
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(down_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        dv = T.decl_buffer((H * d_words,), d_word, data=w_down.data, elem_offset=sel[j] * (H * d_words))
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        pj = T.decl_buffer((1, H), "float16", data=part.data, elem_offset=j * H)
                        down_body(aj, [dv], [pj], bx, ty, tx)

    return {gate_up_name: gate_up.with_attr("global_symbol", gate_up_name),
            down_name: down.with_attr("global_symbol", down_name)}


def make_gpu_moe_rows_kernels(gate_type: str, down_type: str, experts: int, inter: int,
                              hidden: int) -> dict[str, tirx.PrimFunc]:
    """{global symbol: PrimFunc} of the m-row gate_up and down kernels: the one-row kernels' bodies per pair."""
    assert gpu_moe_applies(gate_type, down_type, inter, hidden), (gate_type, down_type, inter, hidden)
    I, H = inter, hidden
    up_body, up_grid, g_words, g_word, gb, _ = int8_kernel_parts(gate_type, I, H, epilogue="swiglu")
    down_body, down_grid, d_words, d_word, db, _ = int8_kernel_parts(down_type, H, I)
    gate_up_name, down_name = gpu_moe_rows_names(gate_type, down_type, experts, I, H)

    @T.prim_func
    def gate_up(x_h: T.handle, sel_h: T.handle, row_h: T.handle, w_gate_h: T.handle, w_up_h: T.handle,
                a_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m, n, slot_rows = T.int32(), T.int32(), T.int32()
        x = T.match_buffer(x_h, (m, H), "float16")
        sel = T.match_buffer(sel_h, (n,), "int32")
        row = T.match_buffer(row_h, (n,), "int32")
        w_gate = T.match_buffer(w_gate_h, (slot_rows, gb), "uint8")          # [slots * I, gb]
        w_up = T.match_buffer(w_up_h, (slot_rows, gb), "uint8")
        a = T.match_buffer(a_h, (n, I), "float16")
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(up_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        gv = T.decl_buffer((I * g_words,), g_word, data=w_gate.data, elem_offset=sel[j] * (I * g_words))
                        uv = T.decl_buffer((I * g_words,), g_word, data=w_up.data, elem_offset=sel[j] * (I * g_words))
                        xr = T.decl_buffer((1, H), "float16", data=x.data, elem_offset=row[j] * H)  # x's row row[j]
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        up_body(xr, [gv, uv], [aj], bx, ty, tx)

    @T.prim_func
    def down(a_h: T.handle, sel_h: T.handle, w_down_h: T.handle, part_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n, slot_rows = T.int32(), T.int32()
        a = T.match_buffer(a_h, (n, I), "float16")
        sel = T.match_buffer(sel_h, (n,), "int32")
        w_down = T.match_buffer(w_down_h, (slot_rows, db), "uint8")          # [slots * H, db]
        part = T.match_buffer(part_h, (n, H), "float16")
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(down_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        dv = T.decl_buffer((H * d_words,), d_word, data=w_down.data, elem_offset=sel[j] * (H * d_words))
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        pj = T.decl_buffer((1, H), "float16", data=part.data, elem_offset=j * H)
                        down_body(aj, [dv], [pj], bx, ty, tx)

    return {gate_up_name: gate_up.with_attr("global_symbol", gate_up_name),
            down_name: down.with_attr("global_symbol", down_name)}
