"""A batched decode step's routed experts of a mixture-of-experts block in one call: m rows (one token of each of
m sequences), every expert any row selected run once for all the rows that chose it, each row's weighted sum.

Why: a step of B sequences selects up to B * k (row, expert) pairs per block, many experts shared (Qwen3-30B-A3B:
8 of 128 per row; a 128-row prompt chunk picks each expert ~8 times). Calling the one-row expert sum
(moe_experts.py) per row reads a shared expert's weights once per row that chose it, and calling the expert function
per expert makes a call, three parallel regions and a host gather per expert. Here one call runs the step: x is
quantized per row and copied to each of the row's pairs (pair order: a group's pairs are contiguous); a parallel
region over (selected expert, block of gate/up rows) runs that block of rows for the expert's pairs in tiles of up
to PAIR_TILE pairs, each tile one m-token GEMV step (tokens_step: gemv_int8's m-token row_dot), so a block's
quants, scales and mins are decoded once per tile rather than once per pair, and the weights come from DRAM once
and from L1 for the next tiles; one region forms each pair's SwiGLU times its weight; one forms every row's output
over its experts' blocks of down, each block of down rows read from DRAM once per step too: where the step's experts
average DOWN_BY_EXPERT pairs or more (a prompt chunk), expert by expert in the same tiles of pairs, each tile adding
into its rows' accumulators (ROWS_PER_CALL rows of them on the stack: a workspace allocation per step cost ~9% at
m = 8-32); with fewer (a decode batch, mostly one pair per expert) row by row, each row's accumulators in registers
over its experts (the expert-by-expert loop's loads and stores of them cost ~9% at m = 8-32 there).
Tiles: the remainder of a group (count % PAIR_TILE pairs) is one tile of that many, a single pair the one-token step
(most groups of a few-row decode step). Qwen3-30B-A3B's shapes (q4_k gate/up, q6_k down) on the quiet 2-core EPYC,
`python -m benchmarks.bench_moe_rows_cpu --rows 1,8,32,128 --reps 10 [--tile T]`, independent rows, median ms at
m = 8 / 32 / 128: T = 1 (no decode shared) 11.1 / 42.5 / 153; T = 4: 10.9 / 36.9 / 116; T = 8: 11.9 / 36.4 / 113
(the dot products stay one per pair and token: only the decode is shared); the kernel before the tiles and the
meta_var row_dots (gemv_int8._macros) 17.4 / 55.8 / 206. Down expert by expert took m = 128 from 119 to 111 ms in
an A/B run and left m = 8 and 32 as they were. Larger tiles than 8 would take two passes over the tokens
(gemv_quant.quant_blocking: accumulators past half the vector registers).

Bits: each pair's gate/up is the one-token GEMV step's sums (gemv_int8: every token's sums are formed as at m = 1)
on that row's x quantized alone, its SwiGLU and weight the one-row kernel's macro (moe_experts.expert_activation),
its down rows the one-row kernel's sums (moe_experts.ExpertSumParts.down_expert, or gemv_int8's m-token row_dot), and
each row's down sum runs over that row's experts in ascending order (the groups' order, and row_pairs' order: as the
runtime passes the one-row kernel) block after block in accumulators of its own: each output row is bit-identical
to the one-row kernel on that row alone.

The one-row kernel is not this one at m = 1: that would pay a parallel region for quantizing x, the pair arrays'
indirections and the serial loop over rows in every decode step of a single sequence (Qwen3-30B-A3B's shapes on the
2-core EPYC, benchmarks/bench_moe_rows_cpu.py --rows 1: 1.5-1.7 ms against the one-row kernel's 1.4-1.6 ms).

The caller describes the step's pairs (n of them) grouped by expert:
  make_moe_expert_rows(gate_type, down_type, experts, inter, hidden, top_k, isa)
      -> PrimFunc(x: f32[m, H], pair_expert: i32[n], pair_row: i32[n], pair_weight: f32[n],
                  group_start: i32[g + 1], row_pairs: i32[n], row_start: i32[m + 1],
                  w_gate: u8[E * I, gb], w_up: u8[E * I, gb], w_down: u8[E * H, db], y: f32[m, H])
  pairs sorted by expert: group u (one expert) is pairs group_start[u] .. group_start[u + 1], the groups ascending;
  row r's pairs, ascending by expert, are row_pairs[row_start[r] .. row_start[r + 1]];
  y[r] = sum over row r's pairs p of pair_weight[p] * expert pair_expert[p](x[r]).
  make_moe_expert_rows(..., biased=BiasedExperts(alpha, limit)): gpt-oss's experts, the biases b_gate, b_up [E, I],
  b_down [E, H] (fp32) after w_down, as moe_experts.make_moe_expert_sum's.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.runtime.function_names import moe_expert_rows_name
from helmc.runtime.moe_experts import ROWS_PER_CALL
from helmc.schedules.cpu.gemv_quant import quant_blocking
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.gemv_int8 import INT8_TUNING, INT8_UNITS, _const, _macros, _ramp, one_token_step
from helmc.schedules.cpu.quant.moe_experts import (BiasedExperts, expert_activation, expert_sum_parts,
                                                   moe_expert_sum_applies)
from helmc.schedules.cpu.quant.prefetch import prefetch_macro
from helmc.schedules.cpu.quant.tiles import _hsum
from helmc.schedules.cpu.weight_load import STACK

PAIR_TILE = 8         # pairs of one expert whose gate/up (and down) blocks are decoded once (see the docstring)
# ... per gate/up type where another tile is faster. MXFP4 (gpt-oss-20b's 32 experts of 2880 x 2880, top-4, biased,
# 128 rows, this module's kernel alone on the quiet 2-core EPYC, median of 3): T = 2 346 ms, T = 4 270, T = 8 403 (16
# rows: 55 / 50 / 53); its 64-weight unit decodes to more live vectors than the K-quants' per pair of the tile.
PAIR_TILES = {"mxfp4": 4}


def pair_tile(gate_type: str) -> int:
    """The tile make_moe_expert_rows uses for experts of this gate/up type."""
    return PAIR_TILES.get(gate_type, PAIR_TILE)
DOWN_BY_EXPERT = 4    # pairs per selected expert from which down runs expert by expert (see the docstring)


def tokens_step(qtype: str, n: int, k: int, isa: VectorIsa, m: int):
    """one_token_step's parallel step for m tokens at once, as a macro of its arguments (xq, dx, xs: [m, ...] views,
    y [m, n]): the step's rows, those of one_token_step, in groups of quant_blocking(qtype, m)'s rows, each group's
    blocks decoded once and multiplied with all m tokens (gemv_int8's m-token row_dot); each token's sums formed as the
    one-token step forms them, so y[t] is bit-identical to one_token_step's on token t alone."""
    if m == 1:
        return one_token_step(qtype, n, k, isa)
    tuning = INT8_TUNING[qtype]
    unit = INT8_UNITS[qtype]
    step_rows, _ = quant_blocking(qtype, 1, isa, tuning)
    rows, group = quant_blocking(qtype, m, isa, tuning)
    assert group == m and step_rows % rows == 0, (qtype, m, rows, group)
    blocks = k // unit.weights
    prefetch = prefetch_macro(rows, unit.bytes, blocks * unit.bytes, tuning, n)
    _, row_dot = _macros(qtype, isa, m, m)

    @T.macro
    def step_tokens(w, wi, wh, wf, wu, xq, dx, xs, y, step):
        for rg in T.serial(step_rows // rows):
            first = T.meta_var(step * step_rows + rg * rows)
            acc = T.alloc_buffer((m, rows, 16), "float32", scope="global", annotations=STACK)
            accm = T.alloc_buffer((m, rows, 8), "float32", scope="global", annotations=STACK)
            for t in T.unroll(m):
                for r in T.unroll(rows):
                    acc[t, r, _ramp(0, 16)] = _const(0.0, "float32", 16)
                    accm[t, r, _ramp(0, 8)] = _const(0.0, "float32", 8)
            for b in T.serial(blocks):
                prefetch(wf, first, b)
                for r in T.unroll(rows):
                    row_dot(w, wi, wh, wu, xq, dx, xs, acc, accm, T.min(first + r, n - 1), r, b, 0)
            for r in T.unroll(rows):
                if first + r < n:
                    for t in T.unroll(m):
                        if unit.mins:
                            y[t, first + r] = _hsum(acc[t, r, _ramp(0, 16)]) - _hsum(accm[t, r, _ramp(0, 8)])
                        else:
                            y[t, first + r] = _hsum(acc[t, r, _ramp(0, 16)])

    return step_tokens


def _pair_tile(qtype: str, inter: int, hidden: int, isa: VectorIsa, size: int):
    """Macro (w_gate, w_up, expert, xq, dx, xs, g, u, first, step): gate and up's step `step` for `size` pairs of one
    expert, pairs first .. first + size of the pair-ordered quantized x (xq, dx, xs) and of g, u [n, I]."""
    I, H = inter, hidden
    unit = INT8_UNITS[qtype]
    blocks = H // unit.weights
    gb = blocks * unit.bytes
    gx, gs = blocks * unit.dx_lanes, blocks * unit.sums
    step_of = tokens_step(qtype, I, H, isa, size)

    @T.macro
    def tile(w_gate, w_up, expert, xq, dx, xs, g, u, first, step):
        row0 = T.meta_var(expert * I)
        xqt = T.decl_buffer((size, H), "int8", data=xq.data, elem_offset=first * H)
        dxt = T.decl_buffer((size, gx), "float32", data=dx.data, elem_offset=first * gx)
        xst = T.decl_buffer((size, gs), unit.xs_dtype, data=xs.data, elem_offset=first * gs)
        gt = T.decl_buffer((size, I), "float32", data=g.data, elem_offset=first * I)    # [size, I] rows of g
        ut = T.decl_buffer((size, I), "float32", data=u.data, elem_offset=first * I)
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
        step_of(wg, wgi, wgh, wgf, wgu, xqt, dxt, xst, gt, step)
        step_of(wu, wui, wuh, wuf, wuu, xqt, dxt, xst, ut, step)

    return tile


def _down_tile(down_type: str, inter: int, hidden: int, isa: VectorIsa, size: int):
    """Macro (w_down, pair_row, expert, aq, adx, axs, accs, accms, first, step): down's step `step` (the one-row
    kernel's d_rows rows of H) for `size` pairs of one expert, pairs first .. first + size of the quantized activations
    (aq, adx, axs), added to their rows' accumulators accs [m, d_rows, 16] / accms [m, d_rows, 8] (held in registers
    over the step's blocks, as ExpertSumParts.down_expert holds them, each pair's sums formed as at one pair)."""
    I, H = inter, hidden
    dn, tuning = INT8_UNITS[down_type], INT8_TUNING[down_type]
    d_blocks = I // dn.weights
    db, ax, axw = d_blocks * dn.bytes, d_blocks * dn.dx_lanes, d_blocks * dn.sums
    step_rows, _ = quant_blocking(down_type, 1, isa, tuning)
    rows, group = quant_blocking(down_type, size, isa, tuning)
    assert group == size and step_rows % rows == 0, (down_type, size, rows, group)
    prefetch = prefetch_macro(rows, dn.bytes, db, tuning, H)
    _, row_dot = _macros(down_type, isa, size, size)

    @T.macro
    def tile(w_down, pair_row, expert, aq, adx, axs, accs, accms, first, step):
        row0 = T.meta_var(expert * H)
        wd = T.decl_buffer((H, db), "uint8", data=w_down.data, elem_offset=row0 * db)
        wdi = T.decl_buffer((H, db), "int8", data=w_down.data, elem_offset=row0 * db)
        wdh = T.decl_buffer((H, db // 2), "float16", data=w_down.data, elem_offset=row0 * (db // 2))
        wdf = T.decl_buffer((H * db,), "uint8", data=w_down.data, elem_offset=row0 * db)
        wdu = T.decl_buffer((H, db // 4), "uint32", data=w_down.data, elem_offset=row0 * (db // 4))
        aqt = T.decl_buffer((size, I), "int8", data=aq.data, elem_offset=first * I)
        adxt = T.decl_buffer((size, ax), "float32", data=adx.data, elem_offset=first * ax)
        axst = T.decl_buffer((size, axw), dn.xs_dtype, data=axs.data, elem_offset=first * axw)
        for rg in T.serial(step_rows // rows):
            acc = T.alloc_buffer((size, rows, 16), "float32", scope="global", annotations=STACK)
            accm = T.alloc_buffer((size, rows, 8), "float32", scope="global", annotations=STACK)
            for t in T.unroll(size):
                for r in T.unroll(rows):
                    acc[t, r, _ramp(0, 16)] = accs[pair_row[first + t], rg * rows + r, _ramp(0, 16)]
                    accm[t, r, _ramp(0, 8)] = accms[pair_row[first + t], rg * rows + r, _ramp(0, 8)]
            for b in T.serial(d_blocks):
                prefetch(wdf, step * step_rows + rg * rows, b)
                for r in T.unroll(rows):
                    row_dot(wd, wdi, wdh, wdu, aqt, adxt, axst, acc, accm,
                            T.min(step * step_rows + rg * rows + r, H - 1), r, b, 0)
            for t in T.unroll(size):
                for r in T.unroll(rows):
                    accs[pair_row[first + t], rg * rows + r, _ramp(0, 16)] = acc[t, r, _ramp(0, 16)]
                    accms[pair_row[first + t], rg * rows + r, _ramp(0, 8)] = accm[t, r, _ramp(0, 8)]

    return tile


def _group_tiles(tiles: dict, tile: int):
    """Macro (a, b, expert, xq, dx, xs, out_a, out_b, first, count, step) running the tile macros `tiles` (size ->
    macro (a, b, expert, xq, dx, xs, out_a, out_b, first, step): _pair_tile's or _down_tile's) over the `count` pairs of
    one expert from pair `first` on: tiles of `tile` pairs, then one tile of the count % tile left."""
    def left(size: int):
        """Macro running the count % tile pairs left when that is size or fewer (sizes from `size` down to 1)."""
        if size == 1:
            @T.macro
            def one(a, b, expert, xq, dx, xs, out_a, out_b, first, rest, step):
                if rest == 1:
                    tiles[1](a, b, expert, xq, dx, xs, out_a, out_b, first, step)
            return one
        this, smaller = tiles[size], left(size - 1)

        @T.macro
        def some(a, b, expert, xq, dx, xs, out_a, out_b, first, rest, step):
            if rest == size:
                this(a, b, expert, xq, dx, xs, out_a, out_b, first, step)
            else:
                smaller(a, b, expert, xq, dx, xs, out_a, out_b, first, rest, step)
        return some

    full, rest = tiles[tile], left(tile - 1) if tile > 1 else None

    @T.macro
    def group(a, b, expert, xq, dx, xs, out_a, out_b, first, count, step):
        for t in T.serial(count // tile):
            full(a, b, expert, xq, dx, xs, out_a, out_b, first + t * tile, step)
        if tile > 1:
            rest(a, b, expert, xq, dx, xs, out_a, out_b, first + count - count % tile, count % tile, step)

    return group


def make_moe_expert_rows(gate_type: str, down_type: str, experts: int, inter: int, hidden: int, top_k: int,
                         isa: VectorIsa, biased: BiasedExperts | None = None, tile: int | None = None) -> tirx.PrimFunc:
    """`biased`: gpt-oss's experts (BiasedExperts), the plain kernel with the one-row biased kernel's bias terms and
    clamped SwiGLU; each row's down biases added after its dot products in its pairs' order, so each row's bits are
    the one-row kernel's. `tile`: pairs of one expert whose blocks are decoded once (1: each pair alone; default
    pair_tile(gate_type))."""
    assert moe_expert_sum_applies(gate_type, down_type, inter, hidden, isa), (gate_type, down_type, inter, hidden)
    tile = tile or pair_tile(gate_type)
    E, I, H, K = experts, inter, hidden, top_k
    k = expert_sum_parts(gate_type, down_type, inter, hidden, isa)
    gu, dn, g_blocks, d_blocks, gb, db, d_rows = k.gate, k.down, k.g_blocks, k.d_blocks, k.gb, k.db, k.d_rows
    activation = expert_activation(biased)
    gx, gs, dx_, ds = gu.dx_lanes, gu.sums, dn.dx_lanes, dn.sums
    sizes = range(1, tile + 1)
    gate_up = _group_tiles({size: _pair_tile(gate_type, I, H, isa, size) for size in sizes}, tile)
    down = _group_tiles({size: _down_tile(down_type, I, H, isa, size) for size in sizes}, tile)

    @T.macro
    def copy_x(xq, dx, xs, pxq, pdx, pxs, row, pair, b):
        for i in T.vectorized(gu.weights):
            pxq[pair, b * gu.weights + i] = xq[row, b * gu.weights + i]
        for i in T.vectorized(gx):
            pdx[pair, b * gx + i] = dx[row, b * gx + i]
        for i in T.vectorized(gs):
            pxs[pair, b * gs + i] = xs[row, b * gs + i]

    @T.macro
    def moe_rows(x_h, pe_h, pr_h, pw_h, gs_h, rp_h, rs_h, w_gate, w_up, w_down, b_gate, b_up, b_down, y_h):
        m, n, m1, ng1 = T.int32(), T.int32(), T.int32(), T.int32()
        x = T.match_buffer(x_h, (m, H), "float32")
        y = T.match_buffer(y_h, (m, H), "float32")
        pair_expert = T.match_buffer(pe_h, (n,), "int32")
        pair_row = T.match_buffer(pr_h, (n,), "int32")
        pair_weight = T.match_buffer(pw_h, (n,), "float32")
        group_start = T.match_buffer(gs_h, (ng1,), "int32")
        row_pairs = T.match_buffer(rp_h, (n,), "int32")
        row_start = T.match_buffer(rs_h, (m1,), "int32")
        T.Assert(m1 == m + 1, "moe_expert_rows: row_start must hold rows + 1 entries")
        T.Assert(n <= m * K, "moe_expert_rows: more pairs than rows times the block's top-k")
        T.Assert(m <= ROWS_PER_CALL, "moe_expert_rows: more rows than ROWS_PER_CALL")
        ng = ng1 - 1
        xq = T.alloc_buffer((m, H), "int8")
        dx = T.alloc_buffer((m, g_blocks * gx), "float32")
        xs = T.alloc_buffer((m, g_blocks * gs), gu.xs_dtype)
        pxq = T.alloc_buffer((n, H), "int8")                              # [n, H] each pair's row of xq, and so on
        pdx = T.alloc_buffer((n, g_blocks * gx), "float32")
        pxs = T.alloc_buffer((n, g_blocks * gs), gu.xs_dtype)
        g = T.alloc_buffer((n, I), "float32")                             # [n, I] each pair's gate(x)
        u = T.alloc_buffer((n, I), "float32")                             # [n, I] up(x), then weight * SwiGLU
        aq = T.alloc_buffer((n, I), "int8")
        adx = T.alloc_buffer((n, d_blocks * dx_), "float32")
        axs = T.alloc_buffer((n, d_blocks * ds), dn.xs_dtype)
        for rb in T.parallel(m * g_blocks):          # x quantized per row, copied to each of the row's pairs
            k.quantize_x(x, xq, dx, xs, rb // g_blocks, rb % g_blocks)
            for q in T.serial(row_start[rb // g_blocks + 1] - row_start[rb // g_blocks]):
                copy_x(xq, dx, xs, pxq, pdx, pxs, rb // g_blocks, row_pairs[row_start[rb // g_blocks] + q],
                       rb % g_blocks)
        for step in T.parallel(ng * k.g_steps):
            grp = T.meta_var(step // k.g_steps)
            gate_up(w_gate, w_up, pair_expert[group_start[grp]], pxq, pdx, pxs, g, u, group_start[grp],
                    group_start[grp + 1] - group_start[grp], step % k.g_steps)
        for jb in T.parallel(n * d_blocks):          # each pair's SwiGLU times its weight, quantized per block
            for i in T.serial(dn.weights):
                activation(g, u, pair_weight, pair_expert, b_gate, b_up, jb // d_blocks, jb % d_blocks * dn.weights + i)
            k.quantize_a(u, aq, adx, axs, jb // d_blocks, jb % d_blocks)
        if n >= DOWN_BY_EXPERT * ng:                 # down decoded once per tile of an expert's pairs
            for step in T.parallel(k.d_steps):       # every row's accumulators, the experts in the groups' order
                accs = T.alloc_buffer((ROWS_PER_CALL, d_rows, 16), "float32", scope="global", annotations=STACK)
                accms = T.alloc_buffer((ROWS_PER_CALL, d_rows, 8), "float32", scope="global", annotations=STACK)
                for r in T.serial(m):
                    k.clear(T.decl_buffer((1, d_rows, 16), "float32", data=accs.data, elem_offset=r * (d_rows * 16)),
                            T.decl_buffer((1, d_rows, 8), "float32", data=accms.data, elem_offset=r * (d_rows * 8)))
                for grp in T.serial(ng):
                    down(w_down, pair_row, pair_expert[group_start[grp]], aq, adx, axs, accs, accms,
                         group_start[grp], group_start[grp + 1] - group_start[grp], step)
                for r in T.serial(m):
                    k.store(y, r, T.decl_buffer((1, d_rows, 16), "float32", data=accs.data,
                                                elem_offset=r * (d_rows * 16)),
                            T.decl_buffer((1, d_rows, 8), "float32", data=accms.data, elem_offset=r * (d_rows * 8)),
                            step)
        else:                                        # down per pair, each row's accumulators in registers
            for step in T.parallel(k.d_steps):
                acc = T.alloc_buffer((1, d_rows, 16), "float32", scope="global", annotations=STACK)
                accm = T.alloc_buffer((1, d_rows, 8), "float32", scope="global", annotations=STACK)
                for r in T.serial(m):
                    k.clear(acc, accm)
                    for q in T.serial(row_start[r + 1] - row_start[r]):
                        p = T.meta_var(row_pairs[row_start[r] + q])
                        k.down_expert(w_down, pair_expert[p], aq, adx, axs, p, acc, accm, step)
                    k.store(y, r, acc, accm, step)
        if biased is not None:
            for rh in T.parallel(m * H):             # the down biases, weighted, in each row's pair order
                for q in T.serial(row_start[rh // H + 1] - row_start[rh // H]):
                    y[rh // H, rh % H] = y[rh // H, rh % H] + pair_weight[row_pairs[row_start[rh // H] + q]] * b_down[
                        pair_expert[row_pairs[row_start[rh // H] + q]], rh % H]

    if biased is None:
        @T.prim_func
        def moe_rows_plain(x_h: T.handle, pe_h: T.handle, pr_h: T.handle, pw_h: T.handle, gs_h: T.handle,
                           rp_h: T.handle, rs_h: T.handle, w_gate: T.Buffer((E * I, gb), "uint8"),
                           w_up: T.Buffer((E * I, gb), "uint8"), w_down: T.Buffer((E * H, db), "uint8"), y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            moe_rows(x_h, pe_h, pr_h, pw_h, gs_h, rp_h, rs_h, w_gate, w_up, w_down, None, None, None, y_h)

        return moe_rows_plain.with_attr("global_symbol", moe_expert_rows_name(gate_type, down_type, E, I, H))

    @T.prim_func
    def moe_rows_biased(x_h: T.handle, pe_h: T.handle, pr_h: T.handle, pw_h: T.handle, gs_h: T.handle,
                        rp_h: T.handle, rs_h: T.handle, w_gate: T.Buffer((E * I, gb), "uint8"),
                        w_up: T.Buffer((E * I, gb), "uint8"), w_down: T.Buffer((E * H, db), "uint8"),
                        b_gate: T.Buffer((E, I), "float32"), b_up: T.Buffer((E, I), "float32"),
                        b_down: T.Buffer((E, H), "float32"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        moe_rows(x_h, pe_h, pr_h, pw_h, gs_h, rp_h, rs_h, w_gate, w_up, w_down, b_gate, b_up, b_down, y_h)

    return moe_rows_biased.with_attr("global_symbol",
                                     moe_expert_rows_name(gate_type, down_type, E, I, H, biased=True))
