"""Prefill GEMM on Intel AMX (Sapphire Rapids and later) for bf16 and fp16 weights: y[t, n] = sum_k x[t, k] * W[n, k].

Why: on the GPU machine's 16-core Xeon, torch's bf16 CPU path runs a 128-token Qwen3-8B block in 8 ms on
AMX while the fp32-FMA GEMM (gemm.py) needs ~60 ms; a prompt's prefill through the CPU blocks is what
long contexts wait for. Selected only when the target's CPU features list amx_tile and amx_bf16.

Formulation: y^T = W . x^T, so HF's row-major [N, K] weight is the A operand as stored.
  A tile (16 weight rows x 32 k, bf16).
  B tile (32 k x 16 tokens) must be in AMX's pair-interleaved ("VNNI") layout: B[kp][2 t + e] = x[t][2 kp + e].
    The fp32 activations are packed into that layout once per call, at the model's precision:
    bf16 weights: rounded to bf16, as HF's bf16 model rounds every linear's input and as torch's bf16 linear
      computes (one product per tile). Against an fp32 GEMM of the unrounded activations that is bf16's
      rounding, ~2e-3 relative; against the rounded activations the fp32 sums give ~1e-6.
    split_activations (fp16 weights always, bf16 on request: helmc build --prefill-activations fp32): x = hi + lo with hi = bf16(x) and
      lo = bf16(x - hi); two products per tile give the activations ~16 mantissa bits (>= fp16's 11), so the
      result matches an fp32 GEMM to ~1e-5. Twice the tile products: on the 16-core Xeon the split bf16
      block prefill ran 0.87-0.9x of torch bf16.
  C tile (16 weight rows x 16 tokens, fp32), stored transposed into y at the end.
fp16 weights (these CPUs have bf16 tiles only): each panel is split into bf16 hi + lo (exact for every fp16
  value) while it is packed, and the step adds Whi.xhi + Whi.xlo + Wlo.xhi (the dropped Wlo.xlo is ~2^-16 of y).
Registers: C 2 x 2 tiles (tmm0-3: 32 weight rows x 32 tokens), A 2 tiles (tmm4-5), B 2 tiles (tmm6-7).

Blocking (measured cause of the first version's 1-6 TFLOP/s on 16 cores: every 32-row task streamed all
packed activations, 2-6 MB, from L3 -- 768 MB of L3 reads for a 128 x 4096 x 12288 GEMM):
  parallel over `tasks` contiguous groups of 32-row panels (one group per core), so each core reads the
    packed activations from L3 once per K block instead of once per panel;
  K in blocks of `k_block`: the activations of one block for a token chunk (128 tokens x 256 k x hi/lo =
    128 KiB) stay in L2 across the group's panels; C partial sums go to a per-task fp32 buffer between
    K blocks (tileloadd / tilestored, L2-resident);
  per panel and K block, the weights (32 rows x k_block) are copied -- fp16: split -- into contiguous tiles
    (16-32 KiB, L1), so the tile loads reused across token blocks hit L1 instead of 16 rows 8 KiB apart
    (which alias one L1 set and 16 L2 set groups for K = 4096);
  the next panel's weight rows are software-prefetched into L2 during the current panel's products, so
    DRAM is read evenly over the run instead of in bursts;
  tokens in chunks of `token_chunk` (the C buffer's size); longer prompts re-read the weights per chunk.
The activations are packed by a vectorised conversion of 16 tokens x 32 k per tile and a 32-bit transpose
through a stack buffer (the first version converted element by element).

Linux gives AMX state only to processes that ask (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
the kernel asks on every call (idempotent, one syscall) and fails with a clear error if refused.

make_gemm_amx_multi: q/k/v (and gate/up) in one launch -- activations packed once, the tasks' panel groups
taken from the concatenation of the weights' panels (separate weight buffers and outputs). blocking_for:
the blocking per (N, K, dtype), as measured on a 16-core Sapphire Rapids Xeon (MEASURED_BLOCKING).

`emulate=True` builds the same loops with each tile instruction replaced by its definition in plain TIR
(tiles as stack arrays), so the packing, indexing, K blocks, chunks and tails are tested on CPUs without AMX.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.amx_blocking import (BLOCKING_VARIANTS, DEFAULT_BLOCKING, MEASURED_BLOCKING, TILE_K, TOKEN_BLOCK,  # noqa: F401
                           AmxBlocking, blocking_for, blocking_named)
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK

TILE_ROWS = 16          # rows of every tile
PANEL_ROWS = 32         # weight rows per panel: two A tiles
A_TILE = TILE_ROWS * TILE_K      # uint16 elements in an A or B tile (1 KiB)
C_TILE = TILE_ROWS * 16          # fp32 elements in a C tile (1 KiB)
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
MULTI_MAX_WEIGHTS = 3   # weights one fused launch reads (q/k/v)

# Benchmark-only switch: when set, helmc/compiler/passes/lower_linear.py builds every AMX GEMM with this blocking instead of
# blocking_for's per-shape choice (benchmarks/bench_cpu_block.py --amx-blocking).
BLOCKING_OVERRIDE: AmxBlocking | None = None


def amx_gemm_applies(n: int, k: int, weight_dtype: str, isa: VectorIsa) -> bool:
    """AMX for bf16 and fp16 weights in whole 32 x 32 tiles; anything else goes to gemm.py."""
    return (isa.has_amx_bf16 and weight_dtype in ("bfloat16", "float16")
            and n % PANEL_ROWS == 0 and k % TILE_K == 0)


def k_block_dividing(k: int, target: int) -> int:
    """Largest multiple of 32 <= target dividing k (k itself a multiple of 32): every K block is whole."""
    for kc in range(min(target, k) // TILE_K * TILE_K, 0, -TILE_K):
        if k % kc == 0:
            return kc
    return TILE_K


def _to_bf16_bits(value):
    """Round-to-nearest-even fp32 -> bf16 bits (as uint16)."""
    bits = T.reinterpret("uint32", value)
    rounded = bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))
    return T.Cast("uint16", rounded >> T.uint32(16))


def _high_half(value):
    """fp32 -> bf16 bits by truncation: exact when the value has at most 8 significant bits."""
    return T.Cast("uint16", T.reinterpret("uint32", value) >> T.uint32(16))


def _bf16_value(bits):
    return T.reinterpret("float32", T.shift_left(T.Cast("uint32", bits), T.uint32(16)))


def _tile_ops(emulate: bool):
    """Macros for the tile instructions; with `emulate` their definitions on stack arrays (ta: 8 x 16 x 32
    uint16 for A/B registers, tc: 4 x 16 x 16 fp32 for C). Offsets are into flat buffers, strides in elements."""

    @T.macro
    def load16(ta, reg, buf, off, stride):          # A/B tile of 16 rows x 32 uint16
        if emulate:
            for i in T.serial(TILE_ROWS):
                for c in T.serial(TILE_K):
                    ta[reg * A_TILE + i * TILE_K + c] = buf[off + i * stride + c]
        else:
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.Cast("int8", reg),
                                          T.address_of(buf[off]), T.Cast("int64", stride * 2)))

    @T.macro
    def load_c(tc, reg, buf, off):
        if emulate:
            for i in T.serial(C_TILE):
                tc[reg * C_TILE + i] = buf[off + i]
        else:
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.Cast("int8", reg),
                                          T.address_of(buf[off]), T.int64(64)))

    @T.macro
    def store_c(tc, reg, buf, off):
        if emulate:
            for i in T.serial(C_TILE):
                buf[off + i] = tc[reg * C_TILE + i]
        else:
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.Cast("int8", reg),
                                          T.address_of(buf[off]), T.int64(64)))

    @T.macro
    def zero_c(tc, reg):
        if emulate:
            for i in T.serial(C_TILE):
                tc[reg * C_TILE + i] = T.float32(0)
        else:
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.Cast("int8", reg)))

    @T.macro
    def dot(ta, tc, c, a, b):                        # C[c] += A[a] . B[b] (bf16 pairs, fp32 sums)
        if emulate:
            for i in T.serial(TILE_ROWS):
                for j in T.serial(16):
                    for kp in T.serial(TILE_ROWS):
                        tc[c * C_TILE + i * 16 + j] = tc[c * C_TILE + i * 16 + j] + \
                            _bf16_value(ta[a * A_TILE + i * TILE_K + 2 * kp]) * \
                            _bf16_value(ta[b * A_TILE + kp * TILE_K + 2 * j]) + \
                            _bf16_value(ta[a * A_TILE + i * TILE_K + 2 * kp + 1]) * \
                            _bf16_value(ta[b * A_TILE + kp * TILE_K + 2 * j + 1])
        else:
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbf16ps", T.Cast("int8", c),
                                          T.Cast("int8", a), T.Cast("int8", b)))

    return load16, load_c, store_c, zero_c, dot


def make_gemm_amx(n: int, k: int, weight_dtype: str = "bfloat16", emulate: bool = False,
                  blocking: AmxBlocking | None = None, split_activations: bool | None = None) -> tirx.PrimFunc:
    """The token count is a symbolic dimension of x and y, so one kernel serves every prompt length."""
    return make_gemm_amx_multi((n,), k, weight_dtype, emulate, blocking, split_activations)


def make_gemm_amx_multi(ns: tuple[int, ...], k: int, weight_dtype: str = "bfloat16", emulate: bool = False,
                        blocking: AmxBlocking | None = None,
                        split_activations: bool | None = None) -> tirx.PrimFunc:
    """y_i[t, :] = x[t] . W_i^T for 1 to MULTI_MAX_WEIGHTS weights of equal K read against the same x, in one
    launch (prefill q/k/v, gate/up): the activations are packed once and the parallel tasks walk the 32-row
    panels of all weights in order (panel p of the concatenation belongs to the weight whose row range holds
    it), so a small weight (k/v) shares the cores with a large one instead of paying its own packing and
    fork/join. Each W_i stays its own HF-layout buffer and each y_i its own output, in the order of `ns`.
    split_activations: None = the model's precision (fp16 weights: split, bf16: rounded to bf16)."""
    ns = tuple(int(v) for v in ns)
    assert 1 <= len(ns) <= MULTI_MAX_WEIGHTS, ns
    assert all(v % PANEL_ROWS == 0 and v > 0 for v in ns) and k % TILE_K == 0, (ns, k)
    assert weight_dtype in ("bfloat16", "float16"), weight_dtype
    blk = blocking or DEFAULT_BLOCKING
    nw = len(ns)
    n0, n1, n2 = (ns + (ns[0], ns[0]))[:3]      # unused sizes (fewer weights) are never referenced
    # First global panel of each weight; off1/off2 past the end when the weight does not exist.
    off1 = n0 // PANEL_ROWS
    off2 = off1 + (n1 // PANEL_ROWS if nw > 1 else 0)
    fp16 = weight_dtype == "float16"
    parts = 2 if fp16 else 1          # fp16 weights: hi and lo bf16 halves (exact); bf16: the weight itself
    split = fp16 if split_activations is None else bool(split_activations)
    assert split or not fp16, "fp16 weights need split activations: one bf16 product would drop below fp16's precision"
    x_parts = 2 if split else 1       # activation parts per B tile: hi (+ lo)
    pack = fp16 or blk.pack_bf16
    prefetch = blk.prefetch
    k_blocks = k // TILE_K            # 32-wide k steps in all of K
    kc = k_block_dividing(k, blk.k_block)
    kcb = kc // TILE_K                # k steps per K block
    nkc = k // kc
    panels = sum(ns) // PANEL_ROWS
    group = -(-panels // blk.tasks)   # panels per task
    tasks = -(-panels // group)
    chunk = blk.token_chunk
    chunk_tiles = chunk // 16         # 16-token B tiles per chunk
    acc_len = group * chunk_tiles * 2 * C_TILE if nkc > 1 else 1
    ws_len = kcb * parts * 2 * A_TILE if pack else 1
    load_dt = "float16" if fp16 else "uint16"
    load16, load_c, store_c, zero_c, dot = _tile_ops(emulate)
    emu_a, emu_c = (8 * A_TILE, 4 * C_TILE) if emulate else (1, 1)

    def xtile(tt, kb, part):
        """Offset of the packed B tile (16-token tile tt, 32-k step kb, activation part: 0 hi, 1 lo)."""
        return ((tt * k_blocks + kb) * x_parts + part) * A_TILE

    @T.macro
    def tile_cfg(cfg):
        for i in T.serial(64):
            cfg[i] = T.uint8(0)
        cfg[0] = T.uint8(1)                         # palette 1
        for t in T.serial(8):
            cfg[16 + 2 * t] = T.uint8(64)           # bytes per row (little-endian uint16 low byte)
            cfg[48 + t] = T.uint8(TILE_ROWS)        # rows

    @T.macro
    def step(ta, tc, ws, wf, xp, row, kcx, s, tt):
        """One 32-k step of a 32 x 32 C block (weight rows row.. of wf); loads interleaved with products so
        that a B register is reloaded as soon as the products reading it are issued. C register a * 2 + b,
        A 4 + a, B 6 + b."""
        if pack:
            load16(ta, 4, ws, ((s * parts) * 2) * A_TILE, TILE_K)
            load16(ta, 5, ws, ((s * parts) * 2 + 1) * A_TILE, TILE_K)
        else:
            load16(ta, 4, wf, row * k + kcx * kc + s * TILE_K, k)
            load16(ta, 5, wf, (row + 16) * k + kcx * kc + s * TILE_K, k)
        # B tile (16-token tile tt + b, k step kcx * kcb + s, part): hi is part 0, lo part 1.
        if fp16:
            # Whi.xlo, then Whi.xhi, then Wlo.xhi: xhi stays in tmm6-7 for both of its products.
            load16(ta, 6, xp, xtile(tt, kcx * kcb + s, 1), TILE_K)
            load16(ta, 7, xp, xtile(tt + 1, kcx * kcb + s, 1), TILE_K)
            dot(ta, tc, 0, 4, 6)
            dot(ta, tc, 2, 5, 6)
            load16(ta, 6, xp, xtile(tt, kcx * kcb + s, 0), TILE_K)
            dot(ta, tc, 1, 4, 7)
            dot(ta, tc, 3, 5, 7)
            load16(ta, 7, xp, xtile(tt + 1, kcx * kcb + s, 0), TILE_K)
            dot(ta, tc, 0, 4, 6)
            dot(ta, tc, 2, 5, 6)
            dot(ta, tc, 1, 4, 7)
            load16(ta, 4, ws, ((s * 2 + 1) * 2) * A_TILE, TILE_K)
            dot(ta, tc, 3, 5, 7)
            load16(ta, 5, ws, ((s * 2 + 1) * 2 + 1) * A_TILE, TILE_K)
            dot(ta, tc, 0, 4, 6)
            dot(ta, tc, 1, 4, 7)
            dot(ta, tc, 2, 5, 6)
            dot(ta, tc, 3, 5, 7)
        else:
            # bf16 weights: W.xhi; split activations add W.xlo, each lo tile loaded as soon as its hi tile's
            # products are issued.
            load16(ta, 6, xp, xtile(tt, kcx * kcb + s, 0), TILE_K)
            load16(ta, 7, xp, xtile(tt + 1, kcx * kcb + s, 0), TILE_K)
            dot(ta, tc, 0, 4, 6)
            dot(ta, tc, 2, 5, 6)
            if x_parts == 2:
                load16(ta, 6, xp, xtile(tt, kcx * kcb + s, 1), TILE_K)
            dot(ta, tc, 1, 4, 7)
            dot(ta, tc, 3, 5, 7)
            if x_parts == 2:
                load16(ta, 7, xp, xtile(tt + 1, kcx * kcb + s, 1), TILE_K)
                dot(ta, tc, 0, 4, 6)
                dot(ta, tc, 2, 5, 6)
                dot(ta, tc, 1, 4, 7)
                dot(ta, tc, 3, 5, 7)

    @T.macro
    def prefetch_rows(wl, next_row, next_col, tb2, s, per):
        """Lines (k step s) of the panel block computed after this one, into L2. The token blocks of this
        panel split its 32 rows between them (`per` each), so the whole next block arrives one panel ahead."""
        for r in T.serial(per):
            if tb2 * per + r < PANEL_ROWS:
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.prefetch",
                    T.address_of(wl[next_row + tb2 * per + r, next_col + s * TILE_K]),
                    T.int32(0), T.int32(2), T.int32(1)))

    @T.macro
    def prefetch_next_panel(wl0, wl1, wl2, next_panel, next_col, tb2, s, per):
        """prefetch_rows in whichever weight holds global panel `next_panel`."""
        if nw == 1:
            prefetch_rows(wl0, next_panel * PANEL_ROWS, next_col, tb2, s, per)
        elif next_panel < off1:
            prefetch_rows(wl0, next_panel * PANEL_ROWS, next_col, tb2, s, per)
        elif nw == 2:
            prefetch_rows(wl1, (next_panel - off1) * PANEL_ROWS, next_col, tb2, s, per)
        elif next_panel < off2:
            prefetch_rows(wl1, (next_panel - off1) * PANEL_ROWS, next_col, tb2, s, per)
        else:
            prefetch_rows(wl2, (next_panel - off2) * PANEL_ROWS, next_col, tb2, s, per)

    @T.macro
    def panel_block(ta, tc, ws, acc, cst, xp, tokens, wl, wf, y, row, p, kcx, ch, blocks, per,
                    wl0, wl1, wl2, next_panel, next_col, next_due):
        """K block kcx of one 32-row panel (rows row.. of wl / wf / y's columns) for every token block of
        chunk ch: pack the weights, run the steps, keep partial sums in acc or store the finished y."""
        if pack:
            for a in T.serial(2):
                for i in T.serial(TILE_ROWS):
                    for s in T.serial(kcb):
                        if fp16:
                            # hi = W's fp32 bits truncated to bf16, lo = W - hi: both exact (an fp16
                            # significand has 11 bits, bf16 8). No let-bound temporary: TVM 0.27's
                            # vectorizer got a let inside this loop wrong.
                            for c in T.vectorized(TILE_K):
                                ws[((s * 2) * 2 + a) * A_TILE + i * TILE_K + c] = _high_half(
                                    T.Cast("float32", wl[row + a * 16 + i, kcx * kc + s * TILE_K + c]))
                            for c in T.vectorized(TILE_K):
                                ws[((s * 2 + 1) * 2 + a) * A_TILE + i * TILE_K + c] = _high_half(
                                    T.Cast("float32", wl[row + a * 16 + i, kcx * kc + s * TILE_K + c])
                                    - _bf16_value(ws[((s * 2) * 2 + a) * A_TILE + i * TILE_K + c]))
                        else:
                            for c in T.vectorized(TILE_K):
                                ws[(s * 2 + a) * A_TILE + i * TILE_K + c] = wl[row + a * 16 + i,
                                                                             kcx * kc + s * TILE_K + c]
        for tb2 in T.serial(blocks):
            for c in T.unroll(4):
                if kcx == 0:
                    zero_c(tc, c)
                else:
                    load_c(tc, c, acc, ((p * chunk_tiles + tb2 * 2 + c % 2) * 2 + c // 2) * C_TILE)
            for s in T.serial(kcb):
                if prefetch and next_due:
                    prefetch_next_panel(wl0, wl1, wl2, next_panel, next_col, tb2, s, per)
                step(ta, tc, ws, wf, xp, row, kcx, s, (ch * chunk_tiles + tb2 * 2))
            if kcx == nkc - 1:
                for c in T.unroll(4):
                    store_c(tc, c, cst, c * C_TILE)
                for b in T.serial(2):
                    for j in T.serial(16):
                        if ch * chunk + tb2 * TOKEN_BLOCK + b * 16 + j < tokens:
                            for a in T.serial(2):
                                for i in T.vectorized(TILE_ROWS):   # a gather from cst
                                    y[ch * chunk + tb2 * TOKEN_BLOCK + b * 16 + j, row + a * 16 + i] = \
                                        cst[(a * 2 + b) * C_TILE + i * 16 + j]
            else:
                for c in T.unroll(4):
                    store_c(tc, c, acc, ((p * chunk_tiles + tb2 * 2 + c % 2) * 2 + c // 2) * C_TILE)

    @T.macro
    def body(tokens, x, wl0, wf0, y0, wl1, wf1, y1, wl2, wf2, y2):
        # Packed activations, flat: tile (16-token tile tt, k step kb, hi/lo part) of 16 kp x 16 tokens x 2
        # at xtile(tt, kb, part); tokens padded to a multiple of 32 with zeros.
        xp = T.alloc_buffer((((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK) * 2 * k_blocks * x_parts * A_TILE,),
                            "uint16")
        xp32 = T.decl_buffer((((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK) * 2 * k_blocks * x_parts * (A_TILE // 2),),
                             "uint32", data=xp.data)
        if not emulate:
            granted = T.call_extern("int64", "syscall", T.int64(SYS_ARCH_PRCTL), T.int64(ARCH_REQ_XCOMP_PERM),
                                    T.int64(XFEATURE_XTILEDATA))
            assert granted == T.int64(0), "AMX GEMM: Linux refused AMX tile state (arch_prctl XTILEDATA)"
        for kb in T.parallel(k_blocks):
            # 16 tokens x 32 k converted row by row (vectorised), then 32-bit pairs transposed into VNNI.
            rows = T.alloc_buffer((x_parts, 16, TILE_K), "uint16", scope="global", annotations=STACK)
            rows32 = T.decl_buffer((x_parts, 16, TILE_K // 2), "uint32", data=rows.data)
            for tt in T.serial(((tokens + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK) * 2):
                for t in T.serial(16):
                    for c in T.vectorized(TILE_K):
                        rows[0, t, c] = _to_bf16_bits(T.if_then_else(
                            tt * 16 + t < tokens, x[T.min(tt * 16 + t, tokens - 1), kb * TILE_K + c], T.float32(0)))
                    if x_parts == 2:
                        for c in T.vectorized(TILE_K):
                            rows[1, t, c] = _to_bf16_bits(T.if_then_else(
                                tt * 16 + t < tokens, x[T.min(tt * 16 + t, tokens - 1), kb * TILE_K + c],
                                T.float32(0)) - _bf16_value(rows[0, t, c]))
                for part in T.serial(x_parts):
                    for kp in T.serial(TILE_ROWS):
                        for t in T.serial(16):
                            xp32[xtile(tt, kb, part) // 2 + kp * 16 + t] = rows32[part, t, kp]
        for task in T.parallel(tasks):
            cfg = T.alloc_buffer((64,), "uint8", scope="global", annotations=STACK)
            cst = T.alloc_buffer((4 * C_TILE,), "float32", scope="global", annotations=STACK)
            # This panel's K block as tiles [k step][part][A tile] (fp16: part 0 = hi, 1 = lo).
            ws = T.alloc_buffer((ws_len,), "uint16", scope="global", annotations=STACK)
            # C partial sums between K blocks: tile (panel in group, 16-token tile in chunk, A tile).
            acc = T.alloc_buffer((acc_len,), "float32")
            ta = T.alloc_buffer((emu_a,), "uint16", scope="global", annotations=STACK)   # emulation only
            tc = T.alloc_buffer((emu_c,), "float32", scope="global", annotations=STACK)  # emulation only
            if not emulate:
                tile_cfg(cfg)
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            for ch in T.serial((tokens + (chunk - 1)) // chunk):
                blocks = T.min(chunk // TOKEN_BLOCK, (tokens - ch * chunk + (TOKEN_BLOCK - 1)) // TOKEN_BLOCK)
                gp = T.min(group, panels - task * group)      # panels of this task
                per = (PANEL_ROWS + blocks - 1) // blocks     # next-panel rows prefetched per token block
                for kcx in T.serial(nkc):
                    for p in T.serial(gp):
                        # The panel block after this one: the next panel, or the first of the next K block / chunk.
                        next_panel = task * group + (kcx * gp + p + 1) % gp
                        next_col = ((kcx * gp + p + 1) // gp % nkc) * kc
                        next_due = (kcx * gp + p + 1) // gp < nkc or ch * chunk + chunk < tokens
                        if nw == 1:
                            panel_block(ta, tc, ws, acc, cst, xp, tokens, wl0, wf0, y0, (task * group + p) * PANEL_ROWS,
                                        p, kcx, ch, blocks, per, wl0, wl1, wl2, next_panel, next_col, next_due)
                        elif task * group + p < off1:
                            panel_block(ta, tc, ws, acc, cst, xp, tokens, wl0, wf0, y0, (task * group + p) * PANEL_ROWS,
                                        p, kcx, ch, blocks, per, wl0, wl1, wl2, next_panel, next_col, next_due)
                        elif nw == 2:
                            panel_block(ta, tc, ws, acc, cst, xp, tokens, wl1, wf1, y1,
                                        (task * group + p - off1) * PANEL_ROWS,
                                        p, kcx, ch, blocks, per, wl0, wl1, wl2, next_panel, next_col, next_due)
                        elif task * group + p < off2:
                            panel_block(ta, tc, ws, acc, cst, xp, tokens, wl1, wf1, y1,
                                        (task * group + p - off1) * PANEL_ROWS,
                                        p, kcx, ch, blocks, per, wl0, wl1, wl2, next_panel, next_col, next_due)
                        else:
                            panel_block(ta, tc, ws, acc, cst, xp, tokens, wl2, wf2, y2,
                                        (task * group + p - off2) * PANEL_ROWS,
                                        p, kcx, ch, blocks, per, wl0, wl1, wl2, next_panel, next_col, next_due)
            if not emulate:
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8}
    if nw == 1:
        @T.prim_func
        def gemm(var_x: T.handle, w0: T.Buffer((n0, k), weight_dtype), var_y0: T.handle):
            T.func_attr(attrs)
            tokens = T.int64()
            x = T.match_buffer(var_x, (tokens, k), "float32")
            y0 = T.match_buffer(var_y0, (tokens, n0), "float32")
            wl0 = T.decl_buffer((n0, k), load_dt, data=w0.data)
            wf0 = T.decl_buffer((n0 * k,), "uint16", data=w0.data)   # A tiles straight from W (bf16, unpacked)
            body(tokens, x, wl0, wf0, y0, wl0, wf0, y0, wl0, wf0, y0)
    elif nw == 2:
        @T.prim_func
        def gemm(var_x: T.handle, w0: T.Buffer((n0, k), weight_dtype), w1: T.Buffer((n1, k), weight_dtype),
                 var_y0: T.handle, var_y1: T.handle):
            T.func_attr(attrs)
            tokens = T.int64()
            x = T.match_buffer(var_x, (tokens, k), "float32")
            y0 = T.match_buffer(var_y0, (tokens, n0), "float32")
            y1 = T.match_buffer(var_y1, (tokens, n1), "float32")
            wl0 = T.decl_buffer((n0, k), load_dt, data=w0.data)
            wf0 = T.decl_buffer((n0 * k,), "uint16", data=w0.data)
            wl1 = T.decl_buffer((n1, k), load_dt, data=w1.data)
            wf1 = T.decl_buffer((n1 * k,), "uint16", data=w1.data)
            body(tokens, x, wl0, wf0, y0, wl1, wf1, y1, wl0, wf0, y0)
    else:
        @T.prim_func
        def gemm(var_x: T.handle, w0: T.Buffer((n0, k), weight_dtype), w1: T.Buffer((n1, k), weight_dtype),
                 w2: T.Buffer((n2, k), weight_dtype), var_y0: T.handle, var_y1: T.handle, var_y2: T.handle):
            T.func_attr(attrs)
            tokens = T.int64()
            x = T.match_buffer(var_x, (tokens, k), "float32")
            y0 = T.match_buffer(var_y0, (tokens, n0), "float32")
            y1 = T.match_buffer(var_y1, (tokens, n1), "float32")
            y2 = T.match_buffer(var_y2, (tokens, n2), "float32")
            wl0 = T.decl_buffer((n0, k), load_dt, data=w0.data)
            wf0 = T.decl_buffer((n0 * k,), "uint16", data=w0.data)
            wl1 = T.decl_buffer((n1, k), load_dt, data=w1.data)
            wf1 = T.decl_buffer((n1 * k,), "uint16", data=w1.data)
            wl2 = T.decl_buffer((n2, k), load_dt, data=w2.data)
            wf2 = T.decl_buffer((n2 * k,), "uint16", data=w2.data)
            body(tokens, x, wl0, wf0, y0, wl1, wf1, y1, wl2, wf2, y2)

    short = "f16" if fp16 else "bf16"
    name = (f"helmc_gemm{nw if nw > 1 else ''}_amx_{short}_n{'_'.join(map(str, ns))}_k{k}"
            + (f"_{blk.name}" if blk.name else "") + ("_xsplit" if split and not fp16 else "")
            + ("_emulated" if emulate else ""))
    return gemm.with_attr("global_symbol", name)
