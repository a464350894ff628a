"""gpt-oss's routed experts of one decode token (or a batched step's (row, expert) pairs) on the GPU in two launches,
over the block's stacked expert weights and biases in VRAM: moe_experts.py's kernels for biased experts with the
clamped SwiGLU, on the fp32-activation GEMV body of quant_gemv.py (gemv_parts: MXFP4, Q8_0 and the other GGUF
types it decodes; k any multiple of the type's block, rows any count).

  gate_up(x: f16[1, H], sel: i32[n], w_gate: u8[slots * I, gb], w_up, b_gate: f32[slots, I], b_up, a: f16[K, I])
      g = x @ gate_sel[j]^T + b_gate[sel[j]], u = x @ up_sel[j]^T + b_up[sel[j]]        (fp32 sums, fp32 biases)
      a[j] = (clamp(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))   (rounded once to fp16)
  down(a: f16[K, I], sel: i32[n], w_down: u8[slots * H, db], b_down: f32[slots, H], part: f16[K, H])
      part[j] = a[j] @ down_sel[j]^T + b_down[sel[j]]
The order of the activation's operations is transformers' GptOssExperts' (and the CPU's BiasedExperts'): gate clamped
above, up both ways, glu = gate * sigmoid(gate * alpha), (up + 1) * glu. The caller weights and sums part[:n] (fp32).
`sel[j]` is a slot of the VRAM stacks, and the biases are stacked in the same slot order, so expert j's weights and
biases are read through views at sel[j]: its result is the bits of the one-weight GEMV's sums on that expert.

The m-row pair (make_gpu_moe_biased_kernels(rows=True)) takes a batched step's pairs: pair j's CTAs read x's row
row[j], so each pair's a and part are the bits the one-row kernels give that row alone.
  gate_up_rows(x: f16[m, H], sel: i32[n], row: i32[n], w_gate, w_up, b_gate, b_up, a: f16[n, I])
  down_rows(a: f16[n, I], sel: i32[n], w_down, b_down, part: f16[n, H])
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.runtime.function_names import gpu_moe_names, gpu_moe_rows_names
from helmc.schedules.gpu.quant_gemv import _INDEX_LIMIT, FORMATS, ROWS_PER_WARP, WARP, WARPS, gemv_parts

_F32 = "float32"


def gpu_moe_biased_applies(gate_type: str, down_type: str, experts: int, inter: int, hidden: int) -> bool:
    """gate/up and down of types the fp32-activation GEMV decodes, whole blocks along H and I, and every stack's
    bytes within int32 indexing."""
    if gate_type not in FORMATS or down_type not in FORMATS:
        return False
    g, d = FORMATS[gate_type], FORMATS[down_type]
    return (hidden % g.weights == 0 and inter % d.weights == 0
            and experts * inter * (hidden // g.weights * g.bytes) < _INDEX_LIMIT
            and experts * hidden * (inter // d.weights * d.bytes) < _INDEX_LIMIT)


def _epilogues(alpha: float, limit: float):
    """(clamped SwiGLU over gate's acc[tok, r] and up's acc[tok, ROWS_PER_WARP + r], down's bias add): the
    GEMV body's store hooks, aux the expert's bias rows."""
    rows = ROWS_PER_WARP

    @T.macro
    def clamped_swiglu(y, aux, acc, tok, r, col):
        gv = T.meta_var(T.min(acc[tok, r] + aux[0][col], T.float32(limit)))
        uv = T.meta_var(T.max(T.min(acc[tok, rows + r] + aux[1][col], T.float32(limit)), T.float32(-limit)))
        y[tok, col] = T.Cast("float16", (uv + T.float32(1)) * (gv / (T.float32(1) + T.exp(gv * T.float32(-alpha)))))

    @T.macro
    def bias_add(y, aux, acc, tok, r, col):
        y[tok, col] = T.Cast("float16", acc[tok, r] + aux[0][col])

    return clamped_swiglu, bias_add


def make_gpu_moe_biased_kernels(gate_type: str, down_type: str, experts: int, inter: int, hidden: int, top_k: int,
                                alpha: float, limit: float, rows: bool = False) -> dict[str, tirx.PrimFunc]:
    """{global symbol: PrimFunc} of the gate_up and down kernels (gpu_moe_names(..., biased=True)); with `rows` the
    m-row pair (gpu_moe_rows_names(..., biased=True)), whose `top_k` is unused (a and part have a row per pair)."""
    assert gpu_moe_biased_applies(gate_type, down_type, experts, inter, hidden), (gate_type, down_type, inter, hidden)
    I, H, K = inter, hidden, top_k
    clamped_swiglu, bias_add = _epilogues(alpha, limit)
    up_body, up_grid, g_words, g_word, gb = gemv_parts(gate_type, I, H, span=2, store=clamped_swiglu)
    down_body, down_grid, d_words, d_word, db = gemv_parts(down_type, H, I, store=bias_add)
    names = (gpu_moe_rows_names if rows else gpu_moe_names)(gate_type, down_type, experts, I, H, biased=True)

    @T.prim_func
    def gate_up(x: T.Buffer((1, H), "float16"), sel_h: T.handle, w_gate_h: T.handle, w_up_h: T.handle,
                b_gate_h: T.handle, b_up_h: T.handle, a: T.Buffer((K, I), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n, slot_rows, slots = T.int32(), T.int32(), T.int32()
        sel = T.match_buffer(sel_h, (n,), "int32")
        w_gate = T.match_buffer(w_gate_h, (slot_rows, gb), "uint8")          # [slots * I, gb]
        w_up = T.match_buffer(w_up_h, (slot_rows, gb), "uint8")
        b_gate = T.match_buffer(b_gate_h, (slots, I), _F32)                 # [slots, I]
        b_up = T.match_buffer(b_up_h, (slots, I), _F32)
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(up_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        gv = T.decl_buffer((I * g_words,), g_word, data=w_gate.data, elem_offset=sel[j] * (I * g_words))
                        uv = T.decl_buffer((I * g_words,), g_word, data=w_up.data, elem_offset=sel[j] * (I * g_words))
                        bg = T.decl_buffer((I,), _F32, data=b_gate.data, elem_offset=sel[j] * I)   # expert's row
                        bu = T.decl_buffer((I,), _F32, data=b_up.data, elem_offset=sel[j] * I)
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        up_body(x, [gv, uv], aj, bx, ty, tx, (bg, bu))

    @T.prim_func
    def gate_up_rows(x_h: T.handle, sel_h: T.handle, row_h: T.handle, w_gate_h: T.handle, w_up_h: T.handle,
                     b_gate_h: T.handle, b_up_h: T.handle, a_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m, n, slot_rows, slots = T.int32(), T.int32(), T.int32(), T.int32()
        x = T.match_buffer(x_h, (m, H), "float16")
        sel = T.match_buffer(sel_h, (n,), "int32")
        row = T.match_buffer(row_h, (n,), "int32")
        w_gate = T.match_buffer(w_gate_h, (slot_rows, gb), "uint8")          # [slots * I, gb]
        w_up = T.match_buffer(w_up_h, (slot_rows, gb), "uint8")
        b_gate = T.match_buffer(b_gate_h, (slots, I), _F32)                 # [slots, I]
        b_up = T.match_buffer(b_up_h, (slots, I), _F32)
        a = T.match_buffer(a_h, (n, I), "float16")
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(up_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        gv = T.decl_buffer((I * g_words,), g_word, data=w_gate.data, elem_offset=sel[j] * (I * g_words))
                        uv = T.decl_buffer((I * g_words,), g_word, data=w_up.data, elem_offset=sel[j] * (I * g_words))
                        bg = T.decl_buffer((I,), _F32, data=b_gate.data, elem_offset=sel[j] * I)   # expert's row
                        bu = T.decl_buffer((I,), _F32, data=b_up.data, elem_offset=sel[j] * I)
                        xr = T.decl_buffer((1, H), "float16", data=x.data, elem_offset=row[j] * H)  # x's row row[j]
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        up_body(xr, [gv, uv], aj, bx, ty, tx, (bg, bu))

    @T.prim_func
    def down(a_h: T.handle, sel_h: T.handle, w_down_h: T.handle, b_down_h: T.handle, part_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        rows_, n, slot_rows, slots = T.int32(), T.int32(), T.int32(), T.int32()
        a = T.match_buffer(a_h, (rows_, I), "float16")                      # [K, I] (one row) or [n, I] (pairs)
        sel = T.match_buffer(sel_h, (n,), "int32")
        w_down = T.match_buffer(w_down_h, (slot_rows, db), "uint8")          # [slots * H, db]
        b_down = T.match_buffer(b_down_h, (slots, H), _F32)                 # [slots, H]
        part = T.match_buffer(part_h, (rows_, H), "float16")
        for j in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(down_grid, thread="blockIdx.x"):
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        dv = T.decl_buffer((H * d_words,), d_word, data=w_down.data, elem_offset=sel[j] * (H * d_words))
                        bd = T.decl_buffer((H,), _F32, data=b_down.data, elem_offset=sel[j] * H)   # expert's row
                        aj = T.decl_buffer((1, I), "float16", data=a.data, elem_offset=j * I)   # [1, I] row j of a
                        pj = T.decl_buffer((1, H), "float16", data=part.data, elem_offset=j * H)
                        down_body(aj, [dv], pj, bx, ty, tx, (bd,))

    return {names[0]: (gate_up_rows if rows else gate_up).with_attr("global_symbol", names[0]),
            names[1]: down.with_attr("global_symbol", names[1])}
