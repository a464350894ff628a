"""Decode GEMV for the CPU stage: y[m, n] = sum_k x[m, k] * W[n, k], W in HF layout [N, K], few static m.

Why this shape of loop (thesis 4.1.5: the CPU stage is only worth having at the DRAM ceiling):
- parallel over rows of W: each thread streams one contiguous slab of the weight, the access pattern the
  hardware prefetchers follow best; HF's row-major [N, K] layout is already that, so no repacking.
- a few rows per step (gemv_blocking), each vectorised along K with `chunk` = 2 registers of fp32 lanes:
  rows x 2 independent FMA chains cover FMA latency and keep several DRAM streams in flight per core.
- batch invariance (a batched decode step must give each sequence the bits its single decode gives):
  every token's y[t, n] is summed the same way whatever m is -- lane v of the `chunk` accumulates
  x[t, k] * W[n, k] for k = v mod chunk in K order, the lanes are added 0..chunk-1, then the K tail in order --
  so `chunk` is the same for every m. One token streams rows as above (row_block); m > 1 tokens take blocks of
  rows over K tiles of x (TiledRows, below), so that x is read from L1 rather than L2 by every row.
- weights widened to fp32 in registers (weight_load.widen), accumulation in fp32 throughout.
- K % chunk leftovers go through a scalar tail loop, so any K is exact.
- each K step software-prefetches every row PREFETCH_STEPS steps ahead (then the next rows), so DRAM
  requests keep running across 4 KiB page ends, where the hardware prefetchers stop (see PREFETCH_STEPS).
x is re-read for every row and stays in L1 (m = 1: 16 KiB at K = 4096) or, by tiles, in L1 (m > 1); only W comes
from DRAM.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK, check_weight_dtype, load_dtype, widen

GEMV_MAX_ROWS = 8   # static token counts up to this use the GEMV; more (or symbolic) use gemm.make_gemm
# Software prefetch, in K steps (one `chunk` of each row per step) ahead of the loads; past the end of the
# rows it runs into the next step's rows. 0: none. Benchmarks may set it (--gemv-prefetch).
# Measured on the GPU machine's 16-core Xeon (one Qwen3-8B block's decode step, noisy
# host, three paired runs of 8 rounds): 16 steps ahead gave 0.97 / 1.15 / 1.08x of the run's roofline where
# none gave 1.18 / 1.21 / 1.17x (2.48 / 2.88 / 3.12 ms against 2.77 / 3.27 / 2.92 ms); 8 ahead gave 1.11x.
PREFETCH_STEPS = 16


# Weight rows per row group of the m > 1 kernel (tiled_blocking); 0: its choice (benchmarks may set it,
# bench_batch_decode --batch-rows).
BATCH_ROWS = 0


def gemv_blocking(isa: VectorIsa, m: int) -> tuple[int, int, int]:
    """(weight rows per step, fp32 elements per row per step, tokens per pass over the step's rows) of the
    row-streaming kernel (row_block), which the m = 1 GEMVs use (m > 1: tiled_blocking).

    Several weight rows per step means several independent DRAM streams per thread and fewer horizontal
    sums; measured on the 2-core EPYC (AVX2, shared machine, best of 10 interleaved passes), 4 rows x 2
    vectors ran 15-17 GB/s where 1 row x 4 vectors ran 11-13 GB/s. For m > 1 (what row_block still supports),
    the group x rows x 2 accumulators stay in half the vector registers: fewer rows per pass or more passes.
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
    name = f"helmc_gemv_{short_dtype(weight_dtype)}_m{m}_n{n}_k{k}"
    if m > 1:
        return _make_gemv_tiled(m, n, k, weight_dtype, isa).with_attr("global_symbol", name)
    rows, chunk, group = gemv_blocking(isa, m)
    steps = -(-n // rows)          # the last step clamps its row index for loads and skips its stores
    block = row_block(m, k, rows, chunk, weight_dtype, not isa.is_slow_fallback, group)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, k), weight_dtype), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wl = T.decl_buffer((n, k), load_dtype(weight_dtype), data=w.data)
        for step in T.parallel(steps):
            block(x, wl, y, n, step * rows)

    return gemv.with_attr("global_symbol", name)


def _make_gemv_tiled(m: int, n: int, k: int, weight_dtype: str, isa: VectorIsa) -> tirx.PrimFunc:
    tiles = TiledRows(m, k, tiled_blocking(isa, m, k), weight_dtype, not isa.is_slow_fallback)
    accumulate, store = tiles.accumulate(), tiles.store()
    rb, slots, chunk = tiles.tb.block_rows, tiles.token_slots, tiles.tb.chunk

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, k), weight_dtype), y: T.Buffer((m, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wl = T.decl_buffer((n, k), load_dtype(weight_dtype), data=w.data)
        for step in T.parallel(-(-n // rb)):
            accs = T.alloc_buffer((rb, slots, chunk), "float32", scope="global", annotations=STACK)
            accumulate(x, wl, n, step * rb, accs, 0, wl, n, (step + 1) * rb)
            store(x, wl, y, n, step * rb, accs)

    return gemv


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


# m > 1 (a batched decode step): the tiled kernel. Why tiles: at m = 8 one step of the row-streaming loop above reads
# m x chunk fp32 of x per chunk of 16-bit weights per row, and m rows of x (8 x 16 KiB at K = 4096, 384 KiB at
# K = 12288) do not fit in L1, so x came from L2 at 8x the weight bytes (2 rows per step, 2 passes) and its misses
# took the L1 fill buffers the weight stream needs. Measured on the 2-core EPYC, one thread, Qwen3-8B shapes
# (benchmarks/bench_cpu_gemv.py --m 1,2,4,8 --threads 1): the
# row-streaming 8-row call took 2.3-2.5x the 1-row time, this one 1.7-1.8x; there the 8 FMAs per weight are the
# limit (from L2 the 8-row kernel runs 5.0 G zmm FMAs/s, 20 GB/s of fp16: DRAM gives it 17), where the GPU
# machine's Xeon cores need ~1.8 G/s each for 8 rows at 113 GB/s.
# A parallel step takes a block of TILE_BLOCK_ROWS rows and walks K in tiles of about X_TILE_BYTES of x
# (all m tokens): for each tile, every row group of the block runs over it, so the x tile is read from L2 once
# per block and from L1 by every row. The accumulators of the block's rows (block rows x m x chunk fp32) live in
# memory between tiles (L1) and in registers within one (loaded and stored once per tile and row group).
# Each lane still accumulates x * w for its k = v mod chunk in K order, from 0, lanes then added 0..chunk-1 and the
# K tail in order: every token's sum is the m = 1 kernel's, bit for bit.
# Software prefetch: each row's line of the next tile (one block tile ahead), or, in the last tile, the same
# row of the next block (wnext/first_next: for the SwiGLU's gate rows the block's up rows).
# The prefetch's lead is one block tile (block rows x tile x 2 bytes: 8 KiB at m = 8), and it matters: on the
# 2-core EPYC (one thread, 12288 x 4096 fp16, m = 8) 8 KiB tiles (4 KiB lead) read 10.3 GB/s, 16 KiB 17.2, 32 KiB
# 17.3; 4 rows per block 12.9, 16 rows 16.5; no prefetch 8.4. Prefetching into L2 (locality 2) instead came out
# within -8..+7% of into L1 at m = 2, 4, 8 on two shapes there (no consistent sign); on the GPU machine's 16-core
# Xeon (12288 x 4096, m = 8, beside a 96-99 GB/s stream
# read) L2 read 67.4 GB/s where L1 read 56.3 (no prefetch 52.2; 4-row blocks 61.4, 16 rows 58.1, 32 KiB tiles
# 56.5): each core's 16 KiB lead of lines no longer evicts the x tile and the accumulators from its 48 KiB L1.
X_TILE_BYTES = 16384   # x bytes per tile (m tokens x tile K x 4): a third of a 48 KiB L1
TILE_BLOCK_ROWS = 8    # weight rows per parallel step; x's L2 reads are 2m / 8 of the weight bytes at fp16
TILE_PREFETCH_LOCALITY = 2   # llvm.prefetch locality of the tiled kernel (2: into L2, 3: L1), 0: no prefetch


@dataclass(frozen=True)
class TiledBlocking:
    rows: int         # weight rows per group (their accumulators in registers together)
    group: int        # tokens per pass over a tile (more tokens: more passes over the same L1-resident rows)
    chunk: int        # fp32 lanes per row and K step: 2 vectors, as the m = 1 kernel (batch invariance)
    tile_steps: int   # K steps (chunks) per tile
    block_rows: int   # rows per parallel step (a multiple of rows)


def tiled_blocking(isa: VectorIsa, m: int, k: int) -> TiledBlocking:
    """Accumulators (group x rows x 2 vectors) in at most half the vector registers; as many rows as that leaves
    for every token in one pass (up to 4: AVX-512 m = 2: 4 rows, m = 3, 4: 2, m = 5..8: 1), more passes only
    where one row's tokens do not fit (AVX2 at m > 4)."""
    chunk = 2 * isa.fp32_lanes
    budget = isa.vector_registers // 2
    rows = min(BATCH_ROWS, budget // 2) if BATCH_ROWS else max(1, min(4, budget // (2 * m)))
    passes = -(-m // max(1, budget // (2 * rows)))
    tile_steps = balanced_tile(k // chunk, X_TILE_BYTES // (m * chunk * 4))
    block_rows = -(-TILE_BLOCK_ROWS // rows) * rows
    return TiledBlocking(rows, -(-m // passes), chunk, tile_steps, block_rows)


def balanced_tile(steps: int, most: int) -> int:
    """Steps per tile: as few tiles of at most `most` steps as cover `steps`, of equal size but the last (so the
    prefetch one tile ahead lands on what the next tile reads)."""
    tiles = max(1, -(-steps // max(1, most)))
    return max(1, -(-steps // tiles))


class TiledRows:
    """The tiled m-row kernel's macros over one weight (see X_TILE_BYTES): accumulate() a block of rows into
    accs[slot .. slot + block_rows, token, lane]; total() one (row, token): lanes in order + K tail; store() the
    block's rows of y."""

    def __init__(self, m: int, k: int, tb: TiledBlocking, weight_dtype: str, f16c: bool):
        self.m, self.k, self.tb, self.dtype, self.f16c = m, k, tb, weight_dtype, f16c
        self.k_main = k // tb.chunk
        self.passes = -(-m // tb.group)
        self.token_slots = self.passes * tb.group     # accs rows per weight row (a partial last pass's extra)

    def accumulate(self):
        m, tb, dtype, f16c = self.m, self.tb, self.dtype, self.f16c
        k_main, passes, chunk, rows, group = self.k_main, self.passes, tb.chunk, tb.rows, tb.group
        half, tile_steps, block_rows = chunk // 2, tb.tile_steps, tb.block_rows
        tiles = -(-k_main // tile_steps)
        slots = self.token_slots
        locality = TILE_PREFETCH_LOCALITY

        @T.macro
        def accumulate(x, wl, n, first, accs, slot, wnext, n_next, first_next):
            for r in T.serial(block_rows):
                for t in T.serial(slots):
                    for v in T.vectorized(chunk):
                        accs[slot + r, t, v] = T.float32(0)
            for kt in T.serial(tiles):
                for rg in T.serial(T.min(block_rows // rows, (n - first + rows - 1) // rows)):
                    for p in T.serial(passes):
                        # two buffers of half the lanes, each < 1 KiB, stay in registers (ACC_SPLIT_WHY)
                        acc = T.alloc_buffer((group, rows, half), "float32", scope="global", annotations=STACK)
                        acc2 = T.alloc_buffer((group, rows, half), "float32", scope="global", annotations=STACK)
                        for t in T.unroll(group):
                            for r in T.unroll(rows):
                                for v in T.vectorized(half):
                                    acc[t, r, v] = accs[slot + rg * rows + r, p * group + t, v]
                                    acc2[t, r, v] = accs[slot + rg * rows + r, p * group + t, half + v]
                        for ko in T.serial(T.min(tile_steps, k_main - kt * tile_steps)):
                            if locality > 0:
                                for r in T.unroll(rows):
                                    if kt + 1 < tiles:
                                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch", T.address_of(wl[
                                            T.min(first + rg * rows + r, n - 1),
                                            T.min((kt + 1) * tile_steps + ko, k_main - 1) * chunk]),
                                            T.int32(0), T.int32(locality), T.int32(1)))
                                    else:
                                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch", T.address_of(wnext[
                                            T.min(first_next + rg * rows + r, n_next - 1),
                                            T.min(ko, k_main - 1) * chunk]),
                                            T.int32(0), T.int32(locality), T.int32(1)))
                            for t in T.unroll(group):
                                for r in T.unroll(rows):
                                    for v in T.vectorized(half):
                                        acc[t, r, v] = acc[t, r, v] + x[
                                            T.min(p * group + t, m - 1), (kt * tile_steps + ko) * chunk + v] * widen(
                                            wl[T.min(first + rg * rows + r, n - 1), (kt * tile_steps + ko) * chunk + v],
                                            dtype, f16c)
                                    for v in T.vectorized(half):
                                        acc2[t, r, v] = acc2[t, r, v] + x[
                                            T.min(p * group + t, m - 1), (kt * tile_steps + ko) * chunk + half + v] \
                                            * widen(wl[T.min(first + rg * rows + r, n - 1),
                                                       (kt * tile_steps + ko) * chunk + half + v], dtype, f16c)
                        for t in T.unroll(group):
                            for r in T.unroll(rows):
                                for v in T.vectorized(half):
                                    accs[slot + rg * rows + r, p * group + t, v] = acc[t, r, v]
                                    accs[slot + rg * rows + r, p * group + t, half + v] = acc2[t, r, v]

        return accumulate

    def total(self):
        """Macro total(x, wl, row, accs, r, t, out, i): out[i] = accs[r, t] lanes 0..chunk-1 added from 0 in order,
        then token t's K tail of weight row `row`, as row_block sums a row."""
        chunk, k_main, dtype, f16c = self.tb.chunk, self.k_main, self.dtype, self.f16c
        k_tail = self.k - k_main * chunk

        @T.macro
        def total(x, wl, row, accs, r, t, out, i):
            out[i] = T.float32(0)
            for v in T.unroll(chunk):
                out[i] = out[i] + accs[r, t, v]
            for kt in T.serial(k_tail):
                out[i] = out[i] + x[t, k_main * chunk + kt] * widen(wl[row, k_main * chunk + kt], dtype, f16c)

        return total

    def store(self):
        """Macro store(x, wl, y, n, first, accs): y[t, first + r] for the block's rows < n and every token."""
        m, rb, total = self.m, self.tb.block_rows, self.total()

        @T.macro
        def store(x, wl, y, n, first, accs):
            for r in T.serial(rb):
                if first + r < n:
                    for t in T.serial(m):
                        out = T.alloc_buffer((1,), "float32", scope="global", annotations=STACK)
                        total(x, wl, first + r, accs, r, t, out, 0)
                        y[t, first + r] = out[0]

        return store


def short_dtype(dtype: str) -> str:
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[dtype]
