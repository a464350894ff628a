"""Decode GEMVs that share one input, as one kernel launch: y_i[m, n_i] = sum_k x[m, k] * W_i[n_i, k].

Why (the block's decode step beyond its GEMVs): every kernel launch is a thread-pool wake-up plus a
ramp of the DRAM streams, and the step is only worth having at the DRAM ceiling. q/k/v read the same
normed x, and so do gate/up; one parallel loop over the rows of all of them costs one launch instead of
three (two), and the small k/v projections no longer run as launches of their own that are too short to
reach full bandwidth on many cores. No weight is repacked: each W_i stays its own HF-layout parameter.

  make_gemv_multi(m, (n_q, n_k, n_v), k, dtype, isa)  -> outputs y_0.., one per weight, in order
  make_gemv_swiglu(m, n, k, dtype, isa)               -> one output: silu(x @ Wg.T) * (x @ Wu.T)

The SwiGLU variant computes gate row r and up row r in the same step and writes g * sigmoid(g) * u, so the
gate and up activations never exist in memory and the separate sigmoid/multiply pass is gone.
Loop structure per step is gemv.py's (rows x chunk fp32 accumulators, widened weight loads, scalar K tail).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.gemv import (GEMV_MAX_ROWS, TiledRows, gemv_blocking, prefetch_ahead, row_block, short_dtype,
                                      tiled_blocking)
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK, check_weight_dtype, load_dtype, widen

MULTI_MAX_WEIGHTS = 3


def make_gemv_multi(m: int, ns: tuple[int, ...], k: int, weight_dtype: str, isa: VectorIsa) -> tirx.PrimFunc:
    """One launch for 2 or 3 weights of equal K read against the same x (q/k/v)."""
    check_weight_dtype(weight_dtype)
    assert 1 <= m <= GEMV_MAX_ROWS, m
    assert 2 <= len(ns) <= MULTI_MAX_WEIGHTS and all(n >= 1 for n in ns) and k >= 1, (ns, k)
    name = f"helmc_gemv{len(ns)}_{short_dtype(weight_dtype)}_m{m}_n{'_'.join(map(str, ns))}_k{k}"
    if m > 1:
        return _make_gemv_multi_tiled(m, ns, k, weight_dtype, isa).with_attr("global_symbol", name)
    rows, chunk, group = gemv_blocking(isa, m)
    steps = [-(-n // rows) for n in ns]
    block = row_block(m, k, rows, chunk, weight_dtype, not isa.is_slow_fallback, group)
    ldt = load_dtype(weight_dtype)
    n0, n1 = ns[0], ns[1]
    s0, s01 = steps[0], steps[0] + steps[1]

    if len(ns) == 2:
        @T.prim_func
        def gemv2(x: T.Buffer((m, k), "float32"), w0: T.Buffer((n0, k), weight_dtype),
                  w1: T.Buffer((n1, k), weight_dtype), y0: T.Buffer((m, n0), "float32"),
                  y1: T.Buffer((m, n1), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            wl0 = T.decl_buffer((n0, k), ldt, data=w0.data)
            wl1 = T.decl_buffer((n1, k), ldt, data=w1.data)
            for step in T.parallel(s01):
                if step < s0:
                    block(x, wl0, y0, n0, step * rows)
                else:
                    block(x, wl1, y1, n1, (step - s0) * rows)

        return gemv2.with_attr("global_symbol", name)

    n2 = ns[2]
    s012 = s01 + steps[2]

    @T.prim_func
    def gemv3(x: T.Buffer((m, k), "float32"), w0: T.Buffer((n0, k), weight_dtype),
              w1: T.Buffer((n1, k), weight_dtype), w2: T.Buffer((n2, k), weight_dtype),
              y0: T.Buffer((m, n0), "float32"), y1: T.Buffer((m, n1), "float32"), y2: T.Buffer((m, n2), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wl0 = T.decl_buffer((n0, k), ldt, data=w0.data)
        wl1 = T.decl_buffer((n1, k), ldt, data=w1.data)
        wl2 = T.decl_buffer((n2, k), ldt, data=w2.data)
        for step in T.parallel(s012):
            if step < s0:
                block(x, wl0, y0, n0, step * rows)
            elif step < s01:
                block(x, wl1, y1, n1, (step - s0) * rows)
            else:
                block(x, wl2, y2, n2, (step - s01) * rows)

    return gemv3.with_attr("global_symbol", name)


def make_gemv_swiglu(m: int, n: int, k: int, weight_dtype: str, isa: VectorIsa) -> tirx.PrimFunc:
    """y[t, r] = g * sigmoid(g) * u with g = x[t] . Wg[r], u = x[t] . Wu[r], fp32 throughout."""
    check_weight_dtype(weight_dtype)
    assert 1 <= m <= GEMV_MAX_ROWS and n >= 1 and k >= 1, (m, n, k)
    name = f"helmc_gemv_swiglu_{short_dtype(weight_dtype)}_m{m}_n{n}_k{k}"
    if m > 1:
        return _make_gemv_swiglu_tiled(m, n, k, weight_dtype, isa).with_attr("global_symbol", name)
    rows, chunk, _ = gemv_blocking(isa, m)
    pairs = max(1, rows // 2)        # gate rows per step; as many up rows: the same number of DRAM streams
    steps = -(-n // pairs)
    # Tokens per pass: the group x 2 x pairs x 2-vector accumulators in half the registers, as gemv_blocking.
    passes = 1 if m == 1 else -(-m // max(1, isa.vector_registers // 2 // (4 * pairs)))
    group = -(-m // passes)
    k_main, k_tail = k // chunk, k - (k // chunk) * chunk
    f16c = not isa.is_slow_fallback
    ldt = load_dtype(weight_dtype)
    prefetch = prefetch_ahead(k_main, pairs, chunk)

    @T.prim_func
    def swiglu(x: T.Buffer((m, k), "float32"), wg: T.Buffer((n, k), weight_dtype),
               wu: T.Buffer((n, k), weight_dtype), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wgl = T.decl_buffer((n, k), ldt, data=wg.data)
        wul = T.decl_buffer((n, k), ldt, data=wu.data)
        for step in T.parallel(steps):
            for p in T.serial(passes):
                # gate and up sums in buffers of their own: < 1 KiB each stays in registers (gemv.ACC_SPLIT_WHY)
                accg = T.alloc_buffer((group, pairs, chunk), "float32", scope="global", annotations=STACK)
                accu = T.alloc_buffer((group, pairs, chunk), "float32", scope="global", annotations=STACK)
                for t in T.unroll(group):
                    for r in T.unroll(pairs):
                        for v in T.vectorized(chunk):
                            accg[t, r, v] = T.float32(0)
                            accu[t, r, v] = T.float32(0)
                for ko in T.serial(k_main):
                    prefetch(wgl, n, step * pairs, ko)
                    prefetch(wul, n, step * pairs, ko)
                    for t in T.unroll(group):
                        for r in T.unroll(pairs):
                            for v in T.vectorized(chunk):
                                accg[t, r, v] = accg[t, r, v] + x[T.min(p * group + t, m - 1), ko * chunk + v] \
                                    * widen(wgl[T.min(step * pairs + r, n - 1), ko * chunk + v], weight_dtype, f16c)
                            for v in T.vectorized(chunk):
                                accu[t, r, v] = accu[t, r, v] + x[T.min(p * group + t, m - 1), ko * chunk + v] \
                                    * widen(wul[T.min(step * pairs + r, n - 1), ko * chunk + v], weight_dtype, f16c)
                for t in T.unroll(group):
                    for r in T.unroll(pairs):
                        if step * pairs + r < n and p * group + t < m:
                            total = T.alloc_buffer((2,), "float32", scope="global", annotations=STACK)
                            total[0] = T.float32(0)
                            total[1] = T.float32(0)
                            for v in T.unroll(chunk):
                                total[0] = total[0] + accg[t, r, v]
                            for v in T.unroll(chunk):
                                total[1] = total[1] + accu[t, r, v]
                            for kt in T.serial(k_tail):
                                total[0] = total[0] + x[p * group + t, k_main * chunk + kt] * widen(
                                    wgl[step * pairs + r, k_main * chunk + kt], weight_dtype, f16c)
                                total[1] = total[1] + x[p * group + t, k_main * chunk + kt] * widen(
                                    wul[step * pairs + r, k_main * chunk + kt], weight_dtype, f16c)
                            y[p * group + t, step * pairs + r] = total[0] * T.sigmoid(total[0]) * total[1]

    return swiglu.with_attr("global_symbol", name)


# m > 1 (a batched decode step): gemv.TiledRows' blocks of rows over K tiles of x (see gemv.X_TILE_BYTES). Each parallel step
# is one block of one weight (q/k/v: blocks never straddle two weights); the SwiGLU step accumulates a block of
# gate rows, then the same block of up rows (its prefetch in the gate's last tile runs into those up rows), and
# combines them row by row. Every token's sums are formed as the m = 1 kernels form them (bit-identical rows).


def _make_gemv_multi_tiled(m: int, ns: tuple[int, ...], k: int, weight_dtype: str, isa: VectorIsa) -> tirx.PrimFunc:
    tiles = TiledRows(m, k, tiled_blocking(isa, m, k), weight_dtype, not isa.is_slow_fallback)
    accumulate, store = tiles.accumulate(), tiles.store()
    rb, slots, chunk = tiles.tb.block_rows, tiles.token_slots, tiles.tb.chunk
    steps = [-(-n // rb) for n in ns]
    ldt = load_dtype(weight_dtype)
    n0, n1 = ns[0], ns[1]
    s0, s01 = steps[0], steps[0] + steps[1]

    @T.macro
    def run(x, wl, y, n, first):
        accs = T.alloc_buffer((rb, slots, chunk), "float32", scope="global", annotations=STACK)
        accumulate(x, wl, n, first, accs, 0, wl, n, first + rb)
        store(x, wl, y, n, first, accs)

    if len(ns) == 2:
        @T.prim_func
        def gemv2(x: T.Buffer((m, k), "float32"), w0: T.Buffer((n0, k), weight_dtype),
                  w1: T.Buffer((n1, k), weight_dtype), y0: T.Buffer((m, n0), "float32"),
                  y1: T.Buffer((m, n1), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            wl0 = T.decl_buffer((n0, k), ldt, data=w0.data)
            wl1 = T.decl_buffer((n1, k), ldt, data=w1.data)
            for step in T.parallel(s01):
                if step < s0:
                    run(x, wl0, y0, n0, step * rb)
                else:
                    run(x, wl1, y1, n1, (step - s0) * rb)

        return gemv2

    n2 = ns[2]

    @T.prim_func
    def gemv3(x: T.Buffer((m, k), "float32"), w0: T.Buffer((n0, k), weight_dtype),
              w1: T.Buffer((n1, k), weight_dtype), w2: T.Buffer((n2, k), weight_dtype),
              y0: T.Buffer((m, n0), "float32"), y1: T.Buffer((m, n1), "float32"), y2: T.Buffer((m, n2), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wl0 = T.decl_buffer((n0, k), ldt, data=w0.data)
        wl1 = T.decl_buffer((n1, k), ldt, data=w1.data)
        wl2 = T.decl_buffer((n2, k), ldt, data=w2.data)
        for step in T.parallel(s01 + steps[2]):
            if step < s0:
                run(x, wl0, y0, n0, step * rb)
            elif step < s01:
                run(x, wl1, y1, n1, (step - s0) * rb)
            else:
                run(x, wl2, y2, n2, (step - s01) * rb)

    return gemv3


def _make_gemv_swiglu_tiled(m: int, n: int, k: int, weight_dtype: str, isa: VectorIsa) -> tirx.PrimFunc:
    tiles = TiledRows(m, k, tiled_blocking(isa, m, k), weight_dtype, not isa.is_slow_fallback)
    accumulate, total = tiles.accumulate(), tiles.total()
    rb, slots, chunk = tiles.tb.block_rows, tiles.token_slots, tiles.tb.chunk
    ldt = load_dtype(weight_dtype)

    @T.prim_func
    def swiglu(x: T.Buffer((m, k), "float32"), wg: T.Buffer((n, k), weight_dtype),
               wu: T.Buffer((n, k), weight_dtype), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wgl = T.decl_buffer((n, k), ldt, data=wg.data)
        wul = T.decl_buffer((n, k), ldt, data=wu.data)
        for step in T.parallel(-(-n // rb)):
            accs = T.alloc_buffer((2 * rb, slots, chunk), "float32", scope="global", annotations=STACK)
            accumulate(x, wgl, n, step * rb, accs, 0, wul, n, step * rb)          # gate rows, then
            accumulate(x, wul, n, step * rb, accs, rb, wgl, n, (step + 1) * rb)   # the same up rows
            for r in T.serial(rb):
                if step * rb + r < n:
                    for t in T.serial(m):
                        out = T.alloc_buffer((2,), "float32", scope="global", annotations=STACK)
                        total(x, wgl, step * rb + r, accs, r, t, out, 0)
                        total(x, wul, step * rb + r, accs, rb + r, t, out, 1)
                        y[t, step * rb + r] = out[0] * T.sigmoid(out[0]) * out[1]

    return swiglu
