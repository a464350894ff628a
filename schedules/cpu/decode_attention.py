"""Decode attention of the CPU stage over its 16-bit KV arena: one query token, one layer (thesis 4.2.3).

Why: at long contexts the CPU layers' decode step is dominated by reading their KV. The floor is reading
every K/V byte once per token in the model's dtype at DRAM bandwidth; NumPy over an fp32 arena read twice
the bytes and converted them in memory. This kernel reads K and V straight from the arena view, widens
each element to fp32 in a register (weight_load.widen: F16C for fp16, `bits << 16` for bf16), and shares
every K/V row among the G = h_a / h_kv query heads of its group (GQA), so each byte is read once.

    make_decode_attention(h_a, h_kv, d, kv_dtype, isa, max_splits) -> PrimFunc named by decode_attention_name

    f(q [h_a, d] f32, k [h_kv, R, d], v [h_kv, R, d], row0 i64, n i64, scale f32, o [h_a, d] f32)
      o[h] = softmax(scale * q[h] . k[h // G, row0:row0+n]) @ v[h // G, row0:row0+n]
    R is symbolic (the arena's row capacity); k/v are declared as uint16 for bf16 (NumPy has no bf16).

Split-K ("flash decoding"): one parallel task per (KV head, split of the n rows); splits =
clamp(n // MIN_SPLIT_ROWS, 1, max_splits), so with 8 KV heads all cores still get work. A task walks its rows
in chunks of CHUNK: scores for the chunk, TB = lanes / G rows at a time (each K piece widened once and used by
the G query heads; the TB x G dot products keep one partial vector each, summed across lanes together by a
shuffle transpose-add tree: lanes - 1 adds per `lanes` scores, where one horizontal sum per (row, head) cost
log2(lanes) dependent store/reload steps each), then the online-softmax update of eqs. 4.18-4.20 (m, s, acc)
for all G heads, with exp as a vectorisable polynomial (LLVM would otherwise call libm's expf once per
score), then P.V one block of output columns at a time so the G x block accumulators stay in vector
registers (all of acc [G, d] did not: every FMA became a load and a store). V rows of the chunk and K rows of
the next chunk are prefetched while the scores are computed (the column-block walk reads V with a stride of
d between rows). Partials (m, s, acc) per (query head, split) go to a workspace; a second parallel loop
merges them (the split-K merge of paged_attention.merge_partials).

Measured on the 2-core EPYC (AVX2, shared machine), Qwen3-8B's layer, fp16 KV, one thread, 4096 rows in
cache, kernel called in a loop: 1.14 ms (14.7 GB/s of K+V) against 1.37 ms (12.3 GB/s) with one horizontal
sum per (row, head). benchmarks/bench_cpu_attention.py (KV evicted before every call, 2 threads, 32K context):
9.0-11.2 ms (12-15 GB/s) against 14.0-18.2 ms before (noisy: the machine is shared).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.runtime.kv.cache_cpu import decode_attention_name  # the runtime looks the kernel up by this name

from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import STACK, load_dtype, widen

KV_DTYPES = ("float16", "bfloat16", "float32")
CHUNK = 64              # rows per online-softmax update: scores of a chunk stay in L1
MIN_SPLIT_ROWS = 256    # a split shorter than this costs more in merging and launch than it saves
NEG_BIG = -3.0e38       # "no score yet": finite, so m_old - m_new never becomes inf - inf

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def default_max_splits(cores: int, num_kv_heads: int) -> int:
    """Splits per KV head so that h_kv x splits is about two tasks per core."""
    return max(1, -(-2 * cores // num_kv_heads))


def fast_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) for float32 x, relative error ~1e-7 (Cephes expf): 2^n * p(r) with r = x - n ln2.
    Inputs below -87.3 give ~1e-38 instead of 0 (callers mask what must be exactly 0). Only selects,
    FMAs, floor and integer shifts, so a vectorised loop stays vectorised."""
    f32 = lambda c: tirx.const(c, "float32")
    x = tirx.max(tirx.min(x, f32(88.3)), f32(-87.3))
    nf = tirx.floor(x * f32(_LOG2E) + f32(0.5))
    r = x - nf * f32(_LN2_HI) - nf * f32(_LN2_LO)
    p = f32(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = p * r + f32(c)
    y = p * r * r + r + f32(1.0)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", nf) + tirx.const(127, "int32"),
                                                        tirx.const(23, "int32")))
    return y * two_n


def _dot_width(head_dim: int, isa: VectorIsa) -> int:
    """fp32 lanes per partial-sum vector of a dot product: one register (a block's TB x G independent
    chains hide the FMA latency), a power of two dividing d so the lane tree needs no tail."""
    w = isa.fp32_lanes
    while w > 1 and head_dim % w:
        w //= 2
    return w


def _pv_width(head_dim: int, group: int, isa: VectorIsa) -> int:
    """Output columns per P.V pass: G x DB fp32 accumulators plus one widened V piece and a broadcast must
    fit the vector registers (a spilled accumulator is a load and a store per FMA), at most 4 vectors per
    head; a power of two dividing d."""
    per_head = max(1, min(4, (isa.vector_registers - 4) // group))
    vectors = 1
    while vectors * 2 <= per_head:
        vectors *= 2
    w = vectors * isa.fp32_lanes
    while w > 1 and head_dim % w:
        w //= 2
    return w


def _tree_reduce(width: int, combine):
    """Macro: buf[g, 0] = combine over buf[g, 0:width] (width a power of two <= 32) by halving, each level
    one vector operation (a serial sum over lanes would be `width` dependent scalar adds)."""

    @T.macro
    def halve(buf, g, half):
        for x in T.vectorized(half):
            buf[g, x] = combine(buf[g, x], buf[g, x + half])

    @T.macro
    def reduce(buf, g):
        if width >= 32:
            halve(buf, g, 16)
        if width >= 16:
            halve(buf, g, 8)
        if width >= 8:
            halve(buf, g, 4)
        if width >= 4:
            halve(buf, g, 2)
        if width >= 2:
            buf[g, 0] = combine(buf[g, 0], buf[g, 1])

    return reduce


def _lane_tree(w: int, groups: int, block_rows: int, group_size: int):
    """Macros summing `groups` x w partial vectors part[v, 0:w] across their lanes, w at a time.

    transpose_add: level l pairs vectors (a, b) that each carry 2^(l-1) sources in segments of s = w / 2^(l-1)
    lanes and adds each segment's two halves, a's sources first: two shuffles and one add per pair, so
    w vectors become one vector holding the w full sums in source order (log2 w levels, w - 1 adds).
    store_scores: sc[g, cb * TB + t] = scale * sum of part[g * TB + t] (NEG_BIG past the chunk's rows), read from
    the tree's last level (the caller passes it: (part, lv1, ..., lv4)[levels], levels returned last)."""
    levels = w.bit_length() - 1
    assert 1 << levels == w and levels <= 4, w

    def idx(level: int, hi: bool) -> list[int]:
        s = w >> (level - 1)
        half = [j * s + t + (s // 2 if hi else 0) for j in range(1 << (level - 1)) for t in range(s // 2)]
        return half + [w + i for i in half]

    (l1, h1), (l2, h2), (l3, h3), (l4, h4) = [(idx(lv, False), idx(lv, True)) if lv <= levels else ([0], [0])
                                              for lv in (1, 2, 3, 4)]
    n1, n2, n3, n4 = (max(1, groups * w >> lv) for lv in (1, 2, 3, 4))
    TB, G = block_rows, group_size

    @T.macro
    def pair_add(src, dst, n, lo, hi):
        for p in T.unroll(n):
            dst[p, T.ramp(0, 1, w)] = (T.Shuffle([src[2 * p, T.ramp(0, 1, w)], src[2 * p + 1, T.ramp(0, 1, w)]], lo)
                                       + T.Shuffle([src[2 * p, T.ramp(0, 1, w)], src[2 * p + 1, T.ramp(0, 1, w)]], hi))

    @T.macro
    def transpose_add(part, lv1, lv2, lv3, lv4):
        if levels >= 1:
            pair_add(part, lv1, n1, l1, h1)
        if levels >= 2:
            pair_add(lv1, lv2, n2, l2, h2)
        if levels >= 3:
            pair_add(lv2, lv3, n3, l3, h3)
        if levels >= 4:
            pair_add(lv3, lv4, n4, l4, h4)

    @T.macro
    def store_scores(sc, top, cb, cnt, scale):
        """top: the tree's last level (part itself when w == 1), one full sum per lane."""
        for g in T.unroll(G):
            for t in T.unroll(TB):
                if levels == 0:
                    sc[g, cb * TB + t] = T.Select(T.int64(cb * TB + t) < cnt, top[g * TB + t, 0] * scale,
                                                  T.float32(NEG_BIG))
                else:
                    sc[g, cb * TB + t] = T.Select(T.int64(cb * TB + t) < cnt,
                                                  top[(g * TB + t) // w, (g * TB + t) % w] * scale, T.float32(NEG_BIG))

    return transpose_add, store_scores, (n1, n2, n3, n4), levels


def make_decode_attention(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str, isa: VectorIsa,
                          max_splits: int = 4) -> tirx.PrimFunc:
    assert kv_dtype in KV_DTYPES, kv_dtype
    assert num_q_heads % num_kv_heads == 0 and head_dim >= 1 and max_splits >= 1, \
        (num_q_heads, num_kv_heads, head_dim, max_splits)
    h_a, h_kv, d = num_q_heads, num_kv_heads, head_dim
    G = h_a // h_kv
    w = _dot_width(d, isa)
    TB = max(1, w // G)                 # rows per score block: TB x G partial vectors, about one per lane
    NG = -(-(TB * G) // w)              # lane trees per block (1 unless G > w or w % G)
    DB = _pv_width(d, G, isa)
    itemsize = 4 if kv_dtype == "float32" else 2
    line_elems = 64 // itemsize
    v_lines = -(-d // line_elems)
    lanes = isa.fp32_lanes
    C = CHUNK
    assert C % lanes == 0
    cl = C // lanes
    transpose_add, store_scores, (n1, n2, n3, n4), levels = _lane_tree(w, NG, TB, G)
    CB = -(-C // TB)                    # score blocks per chunk; rows past the chunk score NEG_BIG
    sum_lanes = _tree_reduce(lanes, lambda a, b: a + b)
    max_lanes = _tree_reduce(lanes, T.max)
    PM = max_splits
    ldt = load_dtype(kv_dtype)
    f16c = not isa.is_slow_fallback

    @T.prim_func
    def attention(q: T.Buffer((h_a, d), "float32"), var_k: T.handle, var_v: T.handle, row0: T.int64, n: T.int64,
                  scale: T.float32, o: T.Buffer((h_a, d), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        R = T.int64()
        k = T.match_buffer(var_k, (h_kv, R, d), ldt)
        v = T.match_buffer(var_v, (h_kv, R, d), ldt)
        assert n >= T.int64(1) and row0 >= T.int64(0) and row0 + n <= R, \
            "decode attention: expected 1 <= n and 0 <= row0 and row0 + n <= arena rows"
        ws_m = T.alloc_buffer((h_a, PM), "float32")
        ws_s = T.alloc_buffer((h_a, PM), "float32")
        ws_o = T.alloc_buffer((h_a, PM, d), "float32")
        splits = T.max(T.int64(1), T.min(T.int64(PM), n // T.int64(MIN_SPLIT_ROWS)))
        per = (n + splits - T.int64(1)) // splits
        for task in T.parallel(h_kv * splits):
            m = T.alloc_buffer((G,), "float32", scope="global", annotations=STACK)
            s = T.alloc_buffer((G,), "float32", scope="global", annotations=STACK)
            acc = T.alloc_buffer((G, d), "float32", scope="global", annotations=STACK)
            sc = T.alloc_buffer((G, CB * TB), "float32", scope="global", annotations=STACK)
            part = T.alloc_buffer((NG * w, w), "float32", scope="global", annotations=STACK)
            lv1 = T.alloc_buffer((n1, w), "float32", scope="global", annotations=STACK)
            lv2 = T.alloc_buffer((n2, w), "float32", scope="global", annotations=STACK)
            lv3 = T.alloc_buffer((n3, w), "float32", scope="global", annotations=STACK)
            lv4 = T.alloc_buffer((n4, w), "float32", scope="global", annotations=STACK)
            kpiece = T.alloc_buffer((TB, w), "float32", scope="global", annotations=STACK)
            red = T.alloc_buffer((1, lanes), "float32", scope="global", annotations=STACK)
            rescale = T.alloc_buffer((G,), "float32", scope="global", annotations=STACK)
            stat = T.alloc_buffer((2,), "float32", scope="global", annotations=STACK)   # m_new, r
            h = task // splits
            lo = (task % splits) * per
            cnt_all = T.max(T.int64(0), T.min(n, lo + per) - lo)
            last = row0 + lo + T.max(cnt_all, T.int64(1)) - T.int64(1)      # this task's last row
            for g in T.unroll(G):
                m[g] = T.float32(NEG_BIG)
                s[g] = T.float32(0)
                for x in T.vectorized(d):
                    acc[g, x] = T.float32(0)
            for ch in T.serial((cnt_all + T.int64(C - 1)) // T.int64(C)):
                base = row0 + lo + ch * T.int64(C)
                cnt = T.min(T.int64(C), cnt_all - ch * T.int64(C))
                # Scores of the chunk, TB rows at a time: each K piece is widened once and feeds the G query
                # heads of its group; the TB x G dot products keep one partial vector each and are summed
                # across lanes together by a transpose-add tree (one add per pair of vectors per level)
                # instead of one horizontal sum per (row, head).
                for cb in T.serial(CB):
                    for v in T.unroll(NG * w):
                        for x in T.vectorized(w):
                            part[v, x] = T.float32(0)
                    for dk in T.unroll(d // w):
                        for t in T.unroll(TB):
                            for x in T.vectorized(w):
                                kpiece[t, x] = widen(k[h, base + T.min(T.int64(cb * TB + t), cnt - T.int64(1)),
                                                       dk * w + x], kv_dtype, f16c)
                        for t in T.unroll(TB):
                            for g in T.unroll(G):
                                for x in T.vectorized(w):
                                    part[g * TB + t, x] = (part[g * TB + t, x]
                                                           + q[h * G + g, dk * w + x] * kpiece[t, x])
                    transpose_add(part, lv1, lv2, lv3, lv4)
                    store_scores(sc, (part, lv1, lv2, lv3, lv4)[levels], cb, cnt, scale)
                    # The P.V pass below walks V column block by column block (stride d between rows), a
                    # pattern the hardware prefetchers ramp up slowly on; fetch these rows' lines now.
                    # K is read in order, but 16 cores stream 2 x h_kv x splits rows at once; fetching the next
                    # chunk's K rows now keeps more lines in flight per core than the L2 streamer alone.
                    for t in T.unroll(TB):
                        for ln in T.unroll(v_lines):
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                                v[h, base + T.min(T.int64(cb * TB + t), cnt - T.int64(1)), ln * line_elems]),
                                T.int32(0), T.int32(3), T.int32(1)))
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                                k[h, T.min(base + T.int64(C + cb * TB + t), last), ln * line_elems]),
                                T.int32(0), T.int32(3), T.int32(1)))
                # Online softmax (eqs. 4.18-4.20): m_new = max(m, max_c e), r = exp(m - m_new),
                # p = exp(e - m_new), s = r s + sum p, acc = r acc + p V.
                for g in T.unroll(G):
                    for x in T.vectorized(lanes):
                        red[0, x] = sc[g, x]
                    for cb in T.unroll(cl - 1):
                        for x in T.vectorized(lanes):
                            red[0, x] = T.max(red[0, x], sc[g, (cb + 1) * lanes + x])
                    max_lanes(red, 0)
                    stat[0] = T.max(m[g], red[0, 0])
                    stat[1] = fast_exp(m[g] - stat[0])
                    m[g] = stat[0]
                    for c in T.vectorized(C):
                        sc[g, c] = T.Select(T.int64(c) < cnt, fast_exp(sc[g, c] - stat[0]), T.float32(0))
                    for x in T.vectorized(lanes):
                        red[0, x] = sc[g, x]
                    for cb in T.unroll(cl - 1):
                        for x in T.vectorized(lanes):
                            red[0, x] = red[0, x] + sc[g, (cb + 1) * lanes + x]
                    sum_lanes(red, 0)
                    s[g] = s[g] * stat[1] + red[0, 0]
                    rescale[g] = stat[1]
                # P.V one column block at a time, so its G x db accumulators live in registers for the chunk.
                for db in T.serial(d // DB):
                    accr = T.alloc_buffer((G, DB), "float32", scope="global", annotations=STACK)
                    vrow = T.alloc_buffer((DB,), "float32", scope="global", annotations=STACK)
                    for g in T.unroll(G):
                        for x in T.vectorized(DB):
                            accr[g, x] = acc[g, db * DB + x] * rescale[g]
                    for c in T.serial(cnt):
                        for x in T.vectorized(DB):
                            vrow[x] = widen(v[h, base + c, db * DB + x], kv_dtype, f16c)
                        for g in T.unroll(G):
                            for x in T.vectorized(DB):
                                accr[g, x] = accr[g, x] + sc[g, c] * vrow[x]
                    for g in T.unroll(G):
                        for x in T.vectorized(DB):
                            acc[g, db * DB + x] = accr[g, x]
            for g in T.unroll(G):
                ws_m[h * G + g, task % splits] = m[g]
                ws_s[h * G + g, task % splits] = s[g]
                for x in T.vectorized(d):
                    ws_o[h * G + g, task % splits, x] = acc[g, x]
        # Merge the splits of every query head: o = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) s_p.
        for hq in T.parallel(h_a):
            tot = T.alloc_buffer((2,), "float32", scope="global", annotations=STACK)     # M, S
            out = T.alloc_buffer((d,), "float32", scope="global", annotations=STACK)
            tot[0] = ws_m[hq, 0]
            for p in T.serial(splits - T.int64(1)):
                tot[0] = T.max(tot[0], ws_m[hq, p + T.int64(1)])
            tot[1] = T.float32(0)
            for x in T.vectorized(d):
                out[x] = T.float32(0)
            for p in T.serial(splits):
                tot[1] = tot[1] + T.exp(ws_m[hq, p] - tot[0]) * ws_s[hq, p]
                for x in T.vectorized(d):
                    out[x] = out[x] + T.exp(ws_m[hq, p] - tot[0]) * ws_o[hq, p, x]
            for x in T.vectorized(d):
                o[hq, x] = out[x] / tot[1]

    return attention.with_attr("global_symbol", decode_attention_name(h_a, h_kv, d, kv_dtype))
