"""Decode GEMV for the CPU stage: y[m, n] = sum_k x[m, k] * W[n, k], W in HF layout [N, K], few static m.

Why this shape of loop (thesis 4.1.5: the CPU stage is only worth having at the DRAM ceiling):
- parallel over rows of W: each thread streams one contiguous slab of the weight, the access pattern the
  hardware prefetchers follow best; HF's row-major [N, K] layout is already that, so no repacking.
- a few rows per step (gemv_blocking), each vectorised along K with `chunk` = 2 registers of fp32 lanes:
  rows x 2 independent FMA chains cover FMA latency and keep several DRAM streams in flight per core.
- batch invariance (issue 19: a batched decode step must give each sequence the bits its single decode gives):
  every token's y[t, n] is summed the same way whatever m is -- lane v of the `chunk` accumulates
  x[t, k] * W[n, k] for k = v mod chunk in K order, the lanes are added 0..chunk-1, then the K tail in order --
  so `chunk` is the same for every m and only rows per step and tokens per pass (`group`) change with m.
  Tokens beyond a pass's `group` (the accumulators must stay in registers) run in further passes over the
  same rows, which then come from L1/L2; every weight byte still comes from DRAM once per call.
- weights widened to fp32 in registers (weight_load.widen), accumulation in fp32 throughout.
- K % chunk leftovers go through a scalar tail loop, so any K is exact.
- each K step software-prefetches every row PREFETCH_STEPS steps ahead (then the next rows), so DRAM
  requests keep running across 4 KiB page ends, where the hardware prefetchers stop (see PREFETCH_STEPS).
x (m x K fp32) is re-read for every row and stays in L1/L2; only W comes from DRAM.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK, check_weight_dtype, load_dtype, widen

GEMV_MAX_ROWS = 8   # static token counts up to this use the GEMV; more (or symbolic) use gemm.make_gemm
# Software prefetch, in K steps (one `chunk` of each row per step) ahead of the loads; past the end of the
# rows it runs into the next step's rows. 0: none. Benchmarks may set it (--gemv-prefetch).
# Measured on the GPU machine's 16-core Xeon (2026-11-21, session 4, one Qwen3-8B block's decode step, noisy
# host, three paired runs of 8 rounds): 16 steps ahead gave 0.97 / 1.15 / 1.08x of the run's roofline where
# none gave 1.18 / 1.21 / 1.17x (2.48 / 2.88 / 3.12 ms against 2.77 / 3.27 / 2.92 ms); 8 ahead gave 1.11x.
PREFETCH_STEPS = 16


# Weight rows per step when m > 1; 0: gemv_blocking's choice (benchmarks may set it, --batch-rows).
BATCH_ROWS = 0


def gemv_blocking(isa: VectorIsa, m: int) -> tuple[int, int, int]:
    """(weight rows per step, fp32 elements per row per step, tokens per pass over the step's rows).

    Several weight rows per step means several independent DRAM streams per thread and fewer horizontal
    sums; measured on the 2-core EPYC (AVX2, shared machine, best of 10 interleaved passes), 4 rows x 2
    vectors ran 15-17 GB/s where 1 row x 4 vectors ran 11-13 GB/s. The chunk is 2 vectors for every m (batch
    invariance, see the module docstring); the group x rows x 2 accumulators must stay in registers next to
    the widened weights and x, so at most half the vector registers hold accumulators, and more tokens get
    fewer rows per pass or more passes: up to 4 rows while one pass holds every token, at least 2 (measured on
    the 2-core EPYC, AVX-512, 4096 x 12288 fp16: m = 2 read 39 GB/s with 4 rows against 34 with 2; m = 4..8
    the same with 2 or 4 rows, 1 row half as fast at m = 8).
    """
    chunk = 2 * isa.fp32_lanes
    if m == 1:
        return 4, chunk, 1
    budget = isa.vector_registers // 2          # accumulators: 16 of AVX-512's 32 registers, 8 of AVX2's 16
    rows = max(1, min(BATCH_ROWS or max(2, min(4, budget // (2 * m))), budget // 2))
    passes = -(-m // max(1, budget // (2 * rows)))
    return rows, chunk, -(-m // passes)         # tokens split evenly over the passes


def make_gemv(m: int, n: int, k: int, weight_dtype: str, isa: VectorIsa) -> tirx.PrimFunc:
    check_weight_dtype(weight_dtype)
    assert 1 <= m <= GEMV_MAX_ROWS, m
    assert n >= 1 and k >= 1, (n, k)
    rows, chunk, group = gemv_blocking(isa, m)
    steps = -(-n // rows)          # the last step clamps its row index for loads and skips its stores
    block = row_block(m, k, rows, chunk, weight_dtype, not isa.is_slow_fallback, group)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, k), weight_dtype), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wl = T.decl_buffer((n, k), load_dtype(weight_dtype), data=w.data)
        for step in T.parallel(steps):
            block(x, wl, y, n, step * rows)

    return gemv.with_attr("global_symbol", f"helmc_gemv_{short_dtype(weight_dtype)}_m{m}_n{n}_k{k}")


# ACC_SPLIT_WHY: an accumulator buffer of 1 KiB or more (16 AVX-512 vectors: 4 tokens x 2 rows x 2 vectors) became
# a TVMBackendAllocWorkspace buffer despite the STACK annotation, and every FMA's result was stored to it (seen in
# the assembly at m = 2, 4, 7, 8: 16 vector stores per K step); two buffers of half the lanes each stay in
# registers. Lane v's sum is the same either way, and the lanes are still added in order 0..chunk-1.


def row_block(m: int, k: int, rows: int, chunk: int, weight_dtype: str, f16c: bool, group: int = 0):
    """Macro: rows [first, first + rows) of one weight (clamped loads, skipped stores past n); K in full
    chunks, then the leftover elements one by one; the m tokens in passes of `group` (default all), a last
    partial pass clamping its token index for loads and skipping its stores. Shared by make_gemv and
    gemv_fused.make_gemv_multi. Token t's arithmetic is the same for every m, group and rows."""
    k_main, k_tail = k // chunk, k - (k // chunk) * chunk
    prefetch = prefetch_ahead(k_main, rows, chunk)
    group = group or m
    passes = -(-m // group)

    half = chunk // 2      # the accumulators in two buffers of < 1 KiB each, see ACC_SPLIT_WHY
    assert 2 * half == chunk, chunk

    @T.macro
    def block(x, wl, y, n, first):
        for p in T.serial(passes):
            acc = T.alloc_buffer((group, rows, half), "float32", scope="global", annotations=STACK)   # lanes 0..
            acc2 = T.alloc_buffer((group, rows, half), "float32", scope="global", annotations=STACK)  # lanes half..
            for t in T.unroll(group):
                for r in T.unroll(rows):
                    for v in T.vectorized(half):
                        acc[t, r, v] = T.float32(0)
                        acc2[t, r, v] = T.float32(0)
            for ko in T.serial(k_main):
                prefetch(wl, n, first, ko)
                for t in T.unroll(group):
                    for r in T.unroll(rows):
                        for v in T.vectorized(half):
                            acc[t, r, v] = acc[t, r, v] + x[T.min(p * group + t, m - 1), ko * chunk + v] * widen(
                                wl[T.min(first + r, n - 1), ko * chunk + v], weight_dtype, f16c)
                        for v in T.vectorized(half):
                            acc2[t, r, v] = acc2[t, r, v] + x[T.min(p * group + t, m - 1), ko * chunk + half + v] \
                                * widen(wl[T.min(first + r, n - 1), ko * chunk + half + v], weight_dtype, f16c)
            for t in T.unroll(group):
                for r in T.unroll(rows):
                    if first + r < n and p * group + t < m:
                        total = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
                        total[0] = T.float32(0)
                        for v in T.unroll(half):
                            total[0] = total[0] + acc[t, r, v]
                        for v in T.unroll(half):
                            total[0] = total[0] + acc2[t, r, v]
                        for kt in T.serial(k_tail):
                            total[0] = total[0] + x[p * group + t, k_main * chunk + kt] * widen(
                                wl[first + r, k_main * chunk + kt], weight_dtype, f16c)
                        y[p * group + t, first + r] = total[0]

    return block


def prefetch_ahead(k_main: int, rows: int, chunk: int):
    """Macro prefetch(wl, n, first, ko): for each of rows [first, first + rows) of wl, K step ko + PREFETCH_STEPS
    (a `chunk` each), or, once past K, that step of the next group of rows (clamped to row n - 1): the DRAM
    requests run ahead across 4 KiB page ends, where the hardware prefetchers stop and restart. Nothing when
    PREFETCH_STEPS is 0."""
    ahead = PREFETCH_STEPS

    @T.macro
    def prefetch(wl, n, first, ko):
        if ahead > 0:
            for r in T.unroll(rows):
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.prefetch", T.address_of(wl[
                        T.min(T.if_then_else(ko + ahead < k_main, first + r, first + rows + r), n - 1),
                        T.if_then_else(ko + ahead < k_main, ko + ahead, T.min(ko + ahead - k_main, k_main - 1))
                        * chunk]),
                    T.int32(0), T.int32(3), T.int32(1)))

    return prefetch


def short_dtype(dtype: str) -> str:
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[dtype]
