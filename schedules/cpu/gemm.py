"""Prefill GEMM for the CPU stage: y[m, n] = sum_k x[m, k] * W[n, k] for a symbolic (or large) token count.

Dot-product micro-kernel on HF's [N, K] layout, so no repacked or fp32 copy of the weight exists:
a tile of `mr` tokens x `nr` weight rows keeps mr*nr vector accumulators along K; each K step loads mr
activation vectors and nr weight vectors (widened in registers) for mr*nr FMAs, and the lanes are summed
once per K block. Cache blocking, per thread (the parallel axis is blocks of `rows_per_task` weight rows):
  K block of `kc` columns: the activation block (tokens x kc fp32) stays in L2 across all row tiles,
  the weight block (rows_per_task x kc) stays in L1/L2 across all token tiles.
Tails: token and weight-row indices past the end are clamped for loads (the tile computes a duplicate)
and skipped for stores, so the inner loop has no branches; K % lanes leftovers run a scalar loop.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.gemv import short_dtype
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK, check_weight_dtype, load_dtype, widen


@dataclass(frozen=True)
class GemmTiling:
    mr: int             # tokens per micro tile
    nr: int             # weight rows per micro tile
    kc: int             # K elements per cache block (multiple of the lane count)
    rows_per_task: int  # weight rows per parallel task (multiple of nr)

    def __post_init__(self):
        assert self.mr >= 1 and self.nr >= 1 and self.kc >= 1, self
        assert self.rows_per_task % self.nr == 0, self


def default_tiling(isa: VectorIsa) -> GemmTiling:
    # Accumulators mr*nr plus nr widened weight vectors plus one activation vector must fit the register file.
    if isa.vector_registers >= 32:
        return GemmTiling(mr=4, nr=4, kc=1024, rows_per_task=32)
    return GemmTiling(mr=4, nr=3, kc=512, rows_per_task=24)


def make_gemm(n: int, k: int, weight_dtype: str, isa: VectorIsa, tiling: GemmTiling | None = None) -> tirx.PrimFunc:
    """The token count is a symbolic dimension of x and y, so one kernel serves every prompt length."""
    check_weight_dtype(weight_dtype)
    body = gemm_body(n, k, weight_dtype, isa, tiling)
    wdt = load_dtype(weight_dtype)

    @T.prim_func
    def gemm(var_x: T.handle, w: T.Buffer((n, k), weight_dtype), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        tokens = T.int64()
        x = T.match_buffer(var_x, (tokens, k), "float32")
        y = T.match_buffer(var_y, (tokens, n), "float32")
        wl = T.decl_buffer((n, k), wdt, data=w.data)
        body(x, wl, y, tokens)

    name = f"helmc_gemm_{short_dtype(weight_dtype)}_n{n}_k{k}"
    return gemm.with_attr("global_symbol", name)


def gemm_body(n: int, k: int, weight_dtype: str, isa: VectorIsa, tiling: GemmTiling | None = None):
    """The GEMM's loop nest as a TIR macro body(x, wl, y, tokens) over a weight `wl` [n, k] in
    load_dtype(weight_dtype): make_gemm's whole body, and the second phase of the quantized prefill GEMM."""
    t = tiling or default_tiling(isa)
    lanes = isa.fp32_lanes
    k_vec = (k // lanes) * lanes          # columns covered by vector steps
    k_tail = k - k_vec
    kc = _block_dividing(k_vec, t.kc, lanes)
    k_blocks = k_vec // kc if k_vec else 0
    mr, nr, rows_per_task = t.mr, t.nr, t.rows_per_task
    tasks = -(-n // rows_per_task)
    f16c = not isa.is_slow_fallback

    @T.macro
    def body(x, wl, y, tokens):
        for task in T.parallel(tasks):
            for kb in T.serial(k_blocks):
                for mo in T.serial((tokens + (mr - 1)) // mr):
                    for jo in T.serial(rows_per_task // nr):
                        acc = T.alloc_buffer((mr, nr, lanes), "float32", scope="global", annotations=STACK)
                        for i in T.unroll(mr):
                            for j in T.unroll(nr):
                                for v in T.vectorized(lanes):
                                    acc[i, j, v] = T.float32(0)
                        for kk in T.serial(kc // lanes):
                            wv = T.alloc_buffer((nr, lanes), "float32", scope="global", annotations=STACK)
                            for j in T.unroll(nr):
                                for v in T.vectorized(lanes):
                                    wv[j, v] = widen(wl[T.min(task * rows_per_task + jo * nr + j, n - 1),
                                                        kb * kc + kk * lanes + v], weight_dtype, f16c)
                            for i in T.unroll(mr):
                                for j in T.unroll(nr):
                                    for v in T.vectorized(lanes):
                                        acc[i, j, v] = acc[i, j, v] + x[
                                            T.min(mo * mr + i, tokens - 1), kb * kc + kk * lanes + v] * wv[j, v]
                        for i in T.unroll(mr):
                            for j in T.unroll(nr):
                                if mo * mr + i < tokens and task * rows_per_task + jo * nr + j < n:
                                    total = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
                                    total[0] = T.if_then_else(
                                        kb == 0, T.float32(0),
                                        y[mo * mr + i, task * rows_per_task + jo * nr + j])
                                    for v in T.unroll(lanes):
                                        total[0] = total[0] + acc[i, j, v]
                                    y[mo * mr + i, task * rows_per_task + jo * nr + j] = total[0]
            if k_tail > 0:
                for row in T.serial(rows_per_task):
                    if task * rows_per_task + row < n:
                        for tok in T.serial(tokens):
                            tail = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
                            tail[0] = T.if_then_else(
                                k_blocks == 0, T.float32(0), y[tok, task * rows_per_task + row])
                            for kt in T.serial(k_tail):
                                tail[0] = tail[0] + x[tok, k_vec + kt] * widen(
                                    wl[task * rows_per_task + row, k_vec + kt], weight_dtype, f16c)
                            y[tok, task * rows_per_task + row] = tail[0]

    return body


def _block_dividing(k_vec: int, target: int, lanes: int) -> int:
    """Largest multiple of `lanes` <= target that divides k_vec: every K block then has the same constant
    trip count, which lets LLVM keep the accumulators in registers (with a variable count it stored them
    to the stack on every iteration)."""
    if k_vec == 0:
        return lanes
    for kc in range(min(target, k_vec) // lanes * lanes, 0, -lanes):
        if k_vec % kc == 0:
            return kc
    return lanes
