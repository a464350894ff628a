"""The CUDA decode kernels' own source, run on the CPU: one std::thread per CUDA thread.

schedules/gpu/paged_attention.py's DECODE_SOURCE is compiled with g++ against a small harness
(threadIdx/blockIdx per thread, __syncthreads and __shfl_xor_sync as barriers over shared
buffers, __shared__ as block-wide statics; blocks run one after another). This checks the
kernel's indexing, its warp and split merges and the split_base / t_begin arguments on a machine
without a GPU; the fp16 load path is the same code the GPU runs. Reference: Algorithm 3 in
float64 over the same fp16 pages (recomputed here). Skipped without g++.
"""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from helmc.runtime.kv.paged_attention import ListPageSource, streaming_attention_decode
from helmc.schedules.gpu.paged_attention import DECODE_SOURCE
from helmc.schedules.gpu.paged_decode_short import SHORT_SOURCE

HARNESS = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;
struct Dim3 { int x = 0, y = 0, z = 0; };
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
thread_local Dim3 threadIdx, blockIdx;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barrier[64];
static float shfl_buf[64][32];
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(x)
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()
#define __threadfence()                 // blocks run one after another: every write is seen
#define __syncwarp() warp_barrier[threadIdx.x >> 5]->arrive_and_wait()
inline float __ldcg(const float* p) { return *p; }
inline int atomicAdd(int* p, int v) { int old = *p; *p = old + v; return old; }   // thread 0 of a block only
inline float __int_as_float(unsigned int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __shfl_xor_sync(unsigned int, float v, int lane_mask) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    warp_barrier[w]->arrive_and_wait();
    shfl_buf[w][l] = v;
    warp_barrier[w]->arrive_and_wait();
    return shfl_buf[w][l ^ lane_mask];
}
float h2f(unsigned short h) {
    unsigned int sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0) { float f = std::ldexp((float)man, -24); return sign ? -f : f; }
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    return __int_as_float(bits);
}
unsigned short f2h(float f) { _Float16 h = (_Float16)f; unsigned short u; std::memcpy(&u, &h, 2); return u; }
"""

DRIVER = r"""
static int reverse_blocks = 0;          // 1: the grid's blocks run last to first (no block may rely on another's writes)
extern "C" void set_reverse_blocks(int r) { reverse_blocks = r; }
static const float* sinks = nullptr;    // the `sinks` every run_* below passes its kernel ([h_a] fp32; null: none)
extern "C" void set_sinks(const float* s) { sinks = s; }
template <class F> static void launch(int gx, int gy, int threads, F body, int gz = 1) {
    for (int i = 0; i < gx * gy * gz; ++i) {
        const int j = reverse_blocks ? gx * gy * gz - 1 - i : i, bz = j / (gx * gy), by = j / gx % gy, bx = j % gx;
        std::barrier<> bb(threads);
        block_barrier = &bb;
        std::vector<std::barrier<>*> wbs;
        for (int w = 0; w < (threads + 31) / 32; ++w) wbs.push_back(warp_barrier[w] = new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
            threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz; body(); });
        for (auto& th : ts) th.join();
        for (auto* b : wbs) delete b;
    }
}
extern "C" void run_partial(const unsigned short* q, const long long* ptrs, int T, const int* step, int span,
                            int split_base, int n_splits, int h_kv, float scale, float* pm, float* ps, float* po) {
    launch(h_kv, n_splits, WARPS * 32, [&] {
        paged_decode_partial(q, ptrs, T, step, span, split_base, h_kv, scale, pm, ps, po); });
}
extern "C" void run_fused(const unsigned short* q, const long long* ptrs, int T, const int* step, int span,
                          int split_base, int n_splits, int h_kv, float scale, float* pm, float* ps, float* po,
                          int* counters, unsigned short* out) {
    launch(h_kv, n_splits, WARPS * 32, [&] {
        paged_decode_fused(q, ptrs, T, step, span, split_base, n_splits, h_kv, scale, pm, ps, po, counters, out,
                           sinks); });
}
extern "C" void run_fused_append(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                 const long long* ptrs, int T, const int* step, int span, int split_base, int n_splits,
                                 int h_kv, float scale, float* pm, float* ps, float* po, int* counters,
                                 unsigned short* out) {
    launch(h_kv, n_splits, WARPS * 32, [&] {
        paged_decode_fused_append(q, k, v, ptrs, T, step, span, split_base, n_splits, h_kv, scale, pm, ps, po,
                                  counters, out, sinks); });
}
extern "C" void run_fused_append_batch(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                       const long long* seqs, int T, int h_kv, float scale, unsigned short* out,
                                       int max_splits, int batch) {
    launch(h_kv, max_splits, WARPS * 32, [&] {
        paged_decode_fused_append_batch(q, k, v, seqs, T, h_kv, scale, out, sinks); }, batch);
}
extern "C" void run_merge(const float* pm, const float* ps, const float* po, int b, int e, int heads,
                          unsigned short* out) {
    launch(heads, 1, HEAD_DIM, [&] { paged_decode_merge(pm, ps, po, b, e, heads, out, sinks); });
}
extern "C" void run_prefill(const unsigned short* q, const unsigned short* kv, int S, int h_kv, int window,
                            float scale, unsigned short* out) {
    launch((S + WARPS - 1) / WARPS, h_kv, WARPS * 32, [&] { prefill_causal(q, kv, S, h_kv, window, scale, out, sinks); });
}
extern "C" void run_append(const unsigned short* k, const unsigned short* v, const long long* ptrs, int T, int h_kv,
                           const int* step) {
    launch(h_kv, 2, HEAD_DIM, [&] { paged_append_decode(k, v, ptrs, T, h_kv, step); });
}
#ifdef SHORT_WARPS
extern "C" void run_short(const unsigned short* q, const long long* ptrs, int T, const int* step, int h_kv,
                          float scale, unsigned short* out) {
    launch(h_kv, GROUP, SHORT_WARPS * 32, [&] { paged_decode_short(q, ptrs, T, step, h_kv, scale, out, sinks); });
}
extern "C" void run_short_append(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                 const long long* ptrs, int T, const int* step, int h_kv, float scale,
                                 unsigned short* out) {
    launch(h_kv, GROUP, SHORT_WARPS * 32, [&] {
        paged_decode_short_append(q, k, v, ptrs, T, step, h_kv, scale, out, sinks); });
}
extern "C" void run_short_append_batch(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                       const long long* seqs, int T, int h_kv, float scale, unsigned short* out,
                                       int batch) {
    launch(h_kv, GROUP, SHORT_WARPS * 32, [&] {
        paged_decode_short_append_batch(q, k, v, seqs, T, h_kv, scale, out, sinks); },
           batch);
}
#endif
"""


def reference(q, pool, slots, T: int, t_begin: int, n: int, scale: float):
    """Algorithm 3 in float64 over the tokens t_begin..n-1 of the pages slots[i] of pool [pages, 2, h_kv, T, d]."""
    pages = []
    for i, s in enumerate(slots):
        a, e = max(t_begin, i * T), min(n, (i + 1) * T)
        if a < e:
            pages.append((pool[s, 0, :, a - i * T:e - i * T].astype(np.float64),
                          pool[s, 1, :, a - i * T:e - i * T].astype(np.float64)))
    return streaming_attention_decode(q.astype(np.float64), ListPageSource(pages), scale)


_LIBS: dict = {}     # (head_dim, group) -> its library: each variant is compiled once per session (g++ takes seconds)


def build(tmp_path, head_dim, group):
    if (head_dim, group) not in _LIBS:
        src = tmp_path / f"kernel_{head_dim}_{group}.cpp"
        src.write_text(HARNESS + DECODE_SOURCE + SHORT_SOURCE + DRIVER)
        lib = tmp_path / f"kernel_{head_dim}_{group}.so"
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-DHEAD_DIM={head_dim}",
                        f"-DGROUP={group}", "-DHELMC_CPU_EMULATION", str(src), "-o", str(lib)], check=True)
        _LIBS[(head_dim, group)] = ctypes.CDLL(str(lib))
    return _LIBS[(head_dim, group)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("h_kv,group,d,T,n,span,t_begin,cut", [
    (2, 4, 128, 16, 45, 16, 0, 1),     # last page partly filled; splits launched as [0,1) then [1,3)
    (1, 8, 64, 8, 40, 16, 0, 2),       # two pages per split
    (2, 1, 96, 5, 23, 5, 9, 3),        # head_dim 96 (3 values per lane), a sliding window start
    (2, 4, 64, 16, 45, 4, 0, 5),       # a quarter page per split (short contexts), empty splits past n
    (1, 2, 64, 8, 300, 8, 20, 9),      # 38 splits: the fused merge stages them 32 at a time; a window start
    (2, 2, 256, 16, 45, 16, 20, 1),    # Gemma 3 12B's head_dim 256 (8 values per lane) and group 2, a window start
])
def test_kernel_source_on_cpu_threads(tmp_path, h_kv, group, d, T, n, span, t_begin, cut):
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(d + group)
    n_pages = -(-n // T)
    pool = rng.standard_normal((n_pages + 2, 2, h_kv, T, d)).astype(np.float16)
    slots = rng.permutation(n_pages + 2)[:n_pages]
    ptrs = np.array([pool.ctypes.data + int(s) * pool[0].nbytes for s in slots], np.int64)
    q = rng.standard_normal((h_kv * group, d)).astype(np.float16)
    h_a, n_splits = h_kv * group, -(-n_pages * T // span)
    pm, ps = np.full(n_splits * h_a, np.nan, np.float32), np.full(n_splits * h_a, np.nan, np.float32)
    po, out = np.full(n_splits * h_a * d, np.nan, np.float32), np.zeros((h_a, d), np.float16)
    first = t_begin // span
    step = np.array([n, t_begin], np.int32)                  # read by the kernel from memory, as on the GPU
    fp, ip, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for s0, s1 in ((first, cut), (cut, n_splits)):           # two launches: split_base is honoured
        lib.run_partial(fp(q.ctypes.data), fp(ptrs.ctypes.data), ip(T), fp(step.ctypes.data), ip(span), ip(s0),
                        ip(s1 - s0), ip(h_kv), f(0.3), fp(pm.ctypes.data), fp(ps.ctypes.data), fp(po.ctypes.data))
    lib.run_merge(fp(pm.ctypes.data), fp(ps.ctypes.data), fp(po.ctypes.data), ip(first), ip(n_splits), ip(h_a),
                  fp(out.ctypes.data))
    ref = reference(q, pool, slots, T, t_begin, n, 0.3)
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    print(f"\nCUDA source on CPU threads, h_kv={h_kv} group={group} d={d} T={T} n={n}: max relative error {err:.2e}")
    assert err < 1e-3                                        # the output is fp16 (2^-11 relative rounding)
    # partial + merge in one launch over the same splits: the same bits, and its counters back at 0
    counters = np.zeros(h_kv, np.int32)
    fused = np.full((h_a, d), np.nan, np.float16)
    for _ in range(2):                                       # a second launch (a graph replay) needs no reset
        pm[:], ps[:], po[:] = np.nan, np.nan, np.nan
        lib.run_fused(fp(q.ctypes.data), fp(ptrs.ctypes.data), ip(T), fp(step.ctypes.data), ip(span), ip(first),
                      ip(n_splits - first), ip(h_kv), f(0.3), fp(pm.ctypes.data), fp(ps.ctypes.data),
                      fp(po.ctypes.data), fp(counters.ctypes.data), fp(fused.ctypes.data))
        assert np.array_equal(fused.view(np.uint16), out.view(np.uint16)) and not counters.any(), counters


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("n", [1, 16, 17, 40])
def test_append_kernel_writes_one_row_of_its_page(tmp_path, n):
    """paged_append_decode puts K and V of token n-1 (step[0] = n) at row (n-1) % T of page (n-1) // T, and
    touches nothing else: the page table and slots are shuffled as a real pool's are."""
    h_kv, group, d, T = 2, 4, 64, 16
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(n)
    n_pages = -(-n // T)
    pool = rng.standard_normal((n_pages + 2, 2, h_kv, T, d)).astype(np.float16)
    before = pool.copy()
    slots = rng.permutation(n_pages + 2)[:n_pages]
    ptrs = np.array([pool.ctypes.data + int(s) * pool[0].nbytes for s in slots], np.int64)
    k, v = (rng.standard_normal((h_kv, d)).astype(np.float16) for _ in range(2))
    step = np.array([n, 0], np.int32)
    fp, ip = ctypes.c_void_p, ctypes.c_int
    lib.run_append(fp(k.ctypes.data), fp(v.ctypes.data), fp(ptrs.ctypes.data), ip(T), ip(h_kv), fp(step.ctypes.data))
    page, row = divmod(n - 1, T)
    expect = before.copy()
    expect[slots[page], 0, :, row], expect[slots[page], 1, :, row] = k, v
    assert np.array_equal(pool, expect)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("h_kv,group,d,S,window", [
    (2, 4, 128, 7, 0),      # the last block's warps past row 6 return at once
    (1, 2, 64, 13, 5),      # a sliding window
    (2, 1, 96, 4, 0),       # head_dim 96: 3 values per lane
])
def test_prefill_kernel_on_cpu_threads(tmp_path, h_kv, group, d, S, window):
    """prefill_causal (a fresh prompt, keys = its own rows) against causal softmax attention in float64."""
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(S + d)
    h_a = h_kv * group
    q = rng.standard_normal((S, h_a, d)).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, S, d)).astype(np.float16)
    out = np.full((S, h_a, d), np.nan, np.float16)
    fp, ip = ctypes.c_void_p, ctypes.c_int
    lib.run_prefill(fp(q.ctypes.data), fp(kv.ctypes.data), ip(S), ip(h_kv), ip(window), ctypes.c_float(0.3),
                    fp(out.ctypes.data))
    k = np.repeat(kv[0].astype(np.float64), group, axis=0)                  # [h_kv, S, d] -> [h_a, S, d]
    v = np.repeat(kv[1].astype(np.float64), group, axis=0)
    e = np.einsum("shd,htd->hst", q.astype(np.float64), k) * 0.3            # [h_a, S, S]
    t = np.arange(S)
    visible = (t[None, :] <= t[:, None]) & ((t[None, :] > t[:, None] - window) if window else True)
    e = np.where(visible[None], e, -np.inf)
    p = np.exp(e - e.max(-1, keepdims=True))
    ref = np.einsum("hst,htd->shd", p / p.sum(-1, keepdims=True), v)
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    print(f"\nprefill_causal on CPU threads, h_kv={h_kv} group={group} d={d} S={S} window={window}: "
          f"max relative error {err:.2e}")
    assert err < 1e-3


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("h_kv,group,d,T,n,span,t_begin", [
    (2, 4, 128, 16, 45, 16, 0),        # the new row mid-page, three splits
    (2, 4, 128, 16, 17, 4, 0),         # the new row first of its page, quarter-page splits
    (1, 8, 64, 8, 40, 16, 0),          # the new row last of its page
    (1, 2, 64, 8, 300, 8, 20),         # 38 splits, a window start
])
def test_fused_append_equals_append_then_fused(tmp_path, h_kv, group, d, T, n, span, t_begin):
    """paged_decode_fused_append gives the bits of paged_append_decode followed by paged_decode_fused: the same
    output and the same pages (the row written, nothing else touched), its counters back at 0."""
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(n + d)
    n_pages = -(-n // T)
    pool = rng.standard_normal((n_pages + 2, 2, h_kv, T, d)).astype(np.float16)
    slots = rng.permutation(n_pages + 2)[:n_pages]
    q = rng.standard_normal((h_kv * group, d)).astype(np.float16)
    k, v = (rng.standard_normal((h_kv, d)).astype(np.float16) for _ in range(2))
    h_a, n_splits = h_kv * group, -(-n_pages * T // span)
    first = t_begin // span
    step = np.array([n, t_begin], np.int32)
    fp, ip, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    results = []
    for fused_append in (False, True):
        pages = pool.copy()
        ptrs = np.array([pages.ctypes.data + int(s) * pages[0].nbytes for s in slots], np.int64)
        pm, ps, po = (np.full(size, np.nan, np.float32) for size in (n_splits * h_a, n_splits * h_a, n_splits * h_a * d))
        counters, out = np.zeros(h_kv, np.int32), np.full((h_a, d), np.nan, np.float16)
        common = (ip(T), fp(step.ctypes.data), ip(span), ip(first), ip(n_splits - first), ip(h_kv), f(0.3),
                  fp(pm.ctypes.data), fp(ps.ctypes.data), fp(po.ctypes.data), fp(counters.ctypes.data),
                  fp(out.ctypes.data))
        if fused_append:
            # The new row's page slot holds garbage and the blocks run last to first: the split that reads token
            # n-1 runs before block (j, 0) writes it, so only a kernel that takes the row from k/v passes.
            page, row = divmod(n - 1, T)
            pages[slots[page], :, :, row] = np.nan
            lib.set_reverse_blocks(1)
            lib.run_fused_append(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), fp(ptrs.ctypes.data),
                                 *common)
            lib.set_reverse_blocks(0)
        else:
            lib.run_append(fp(k.ctypes.data), fp(v.ctypes.data), fp(ptrs.ctypes.data), ip(T), ip(h_kv),
                           fp(step.ctypes.data))
            lib.run_fused(fp(q.ctypes.data), fp(ptrs.ctypes.data), *common)
        assert not counters.any() and np.isfinite(out.astype(np.float32)).all()
        results.append((out.copy(), pages))
    (out0, pages0), (out1, pages1) = results
    print(f"\nfused append, h_kv={h_kv} group={group} d={d} T={T} n={n}: outputs equal "
          f"{np.array_equal(out0.view(np.uint16), out1.view(np.uint16))}, pages equal {np.array_equal(pages0, pages1)}")
    assert np.array_equal(out0.view(np.uint16), out1.view(np.uint16)) and np.array_equal(pages0, pages1)
    assert not np.array_equal(pages0, pool)                  # the row was written



def test_batch_table_fields_match_the_source():
    """The host's row of paged_decode_fused_append_batch's table (runtime/kv/decode_batch_gpu.py) and the schedule's
    field list name the source's SEQ_* indices."""
    import re

    from helmc.runtime.kv.decode_batch_gpu import SEQ_FIELDS as RUNTIME_FIELDS
    from helmc.schedules.gpu.paged_attention import SEQ_FIELDS
    defines = dict(re.findall(r"#define SEQ_(\w+) (\d+)", DECODE_SOURCE))
    assert RUNTIME_FIELDS == SEQ_FIELDS
    assert {name.upper(): str(i) for i, name in enumerate(SEQ_FIELDS)} | {"FIELDS": str(len(SEQ_FIELDS))} == defines


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("h_kv,group,d,T", [(2, 4, 128, 16), (1, 2, 64, 8)])
def test_fused_append_batch_is_each_sequence_alone(tmp_path, h_kv, group, d, T):
    """paged_decode_fused_append_batch over sequences of different lengths, page tables (each its own pool, slots
    shuffled), splits (whole pages, quarter pages, a window's first split) and partial buffers: each sequence's
    output and pages are the bits of paged_decode_fused_append run for it alone, within fp16 rounding of the float64
    reference, its counters back at 0; the padding row after the sequences' is left alone. Blocks run last to first
    with the new rows' page slots poisoned, as in test_fused_append_equals_append_then_fused."""
    from helmc.schedules.gpu.paged_attention import SEQ_FIELDS
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(d + T)
    # (tokens after the append, tokens per split, window start): 3 splits; 4 quarter-page splits of 1 page;
    # 38 splits staged 32 at a time, from split 2 on (a window); the new row first of its page
    seqs = [(45, T, 0), (T // 2, T // 4, 0), (38 * T - 3, T, 2 * T + 1), (2 * T + 1, T, 0)]
    B, h_a = len(seqs), h_kv * group
    q = rng.standard_normal((B + 1, h_a, d)).astype(np.float16)          # row B: padding
    k, v = (rng.standard_normal((B + 1, h_kv, d)).astype(np.float16) for _ in range(2))
    fp, ip, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    alone, keep = [], []
    table = np.zeros((B, len(SEQ_FIELDS)), np.int64)
    pools, batch_pools = [], []
    for b, (n, span, t_begin) in enumerate(seqs):
        n_pages = -(-n // T)
        pool = rng.standard_normal((n_pages + 2, 2, h_kv, T, d)).astype(np.float16)
        slots = rng.permutation(n_pages + 2)[:n_pages]
        n_splits, first = -(-n_pages * T // span), t_begin // span
        step = np.array([n, t_begin], np.int32)
        one = pool.copy()
        ptrs = np.array([one.ctypes.data + int(s) * one[0].nbytes for s in slots], np.int64)
        pm, ps, po = (np.full(size, np.nan, np.float32) for size in (n_splits * h_a, n_splits * h_a, n_splits * h_a * d))
        counters, out = np.zeros(h_kv, np.int32), np.full((h_a, d), np.nan, np.float16)
        lib.run_fused_append(fp(q[b].ctypes.data), fp(k[b].ctypes.data), fp(v[b].ctypes.data), fp(ptrs.ctypes.data),
                             ip(T), fp(step.ctypes.data), ip(span), ip(first), ip(n_splits - first), ip(h_kv), f(0.3),
                             fp(pm.ctypes.data), fp(ps.ctypes.data), fp(po.ctypes.data), fp(counters.ctypes.data),
                             fp(out.ctypes.data))
        alone.append(out)
        pools.append((one, slots))
        many = pool.copy()
        page, row = divmod(n - 1, T)
        many[slots[page], :, :, row] = np.nan                            # the batch kernel must take it from k, v
        bptrs = np.array([many.ctypes.data + int(s) * many[0].nbytes for s in slots], np.int64)
        parts = tuple(np.full(size, np.nan, np.float32) for size in (n_splits * h_a, n_splits * h_a, n_splits * h_a * d))
        bcounters = np.zeros(h_kv, np.int32)
        keep.append((bptrs, step, parts, bcounters))
        batch_pools.append(many)
        table[b] = [bptrs.ctypes.data, step.ctypes.data, *(a.ctypes.data for a in parts), bcounters.ctypes.data,
                    span, first, n_splits - first]
    out = np.zeros((B + 1, h_a, d), np.float16)
    lib.set_reverse_blocks(1)
    lib.run_fused_append_batch(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), fp(table.ctypes.data), ip(T),
                               ip(h_kv), f(0.3), fp(out.ctypes.data), ip(int(table[:, -1].max())), ip(B))
    lib.set_reverse_blocks(0)
    assert not out[B].any(), "the padding row was written"
    for b, (n, span, t_begin) in enumerate(seqs):
        (one, slots), many = pools[b], batch_pools[b]
        assert not keep[b][3].any(), (b, keep[b][3])
        assert np.array_equal(out[b].view(np.uint16), alone[b].view(np.uint16)), f"sequence {b}: output differs"
        assert np.array_equal(many, one), f"sequence {b}: pages differ"
        ref = reference(q[b], one, slots, T, t_begin, n, 0.3)
        err = float(np.abs(out[b].astype(np.float64) - ref).max() / np.abs(ref).max())
        print(f"\nbatched fused append, sequence {b} (n={n}, span={span}, t_begin={t_begin}): bits equal to its "
              f"own launch; max relative error {err:.2e}")
        assert err < 1e-3


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("h_kv,group,d,T,n,t_begin", [
    (2, 4, 128, 16, 45, 0),            # three pages, the last partly filled
    (1, 8, 64, 8, 40, 9),              # a window start; the new row last of its page
    (1, 2, 32, 512, 300, 0),           # one big page; 128 rows a pass (4 lanes a row)
    (1, 4, 256, 16, 1, 0),             # the first token: one row, 32 lanes a row
    (2, 2, 256, 16, 30, 14),           # Gemma 3 12B's heads past a sliding window of 16
])
def test_short_kernels_on_cpu_threads(tmp_path, h_kv, group, d, T, n, t_begin):
    """paged_decode_short (schedules/gpu/paged_decode_short.py) after paged_append_decode is within fp16 rounding of
    the float64 reference; paged_decode_short_append gives its bits and pages with the new row's slot poisoned and
    the blocks run last to first; the batch kernel gives a short sequence the same bits and leaves a sequence
    marked for the split kernel (n_splits > 0) alone."""
    from helmc.schedules.gpu.paged_attention import SEQ_FIELDS
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(n + d + T)
    n_pages, h_a = -(-n // T), h_kv * group
    pool = rng.standard_normal((n_pages + 2, 2, h_kv, T, d)).astype(np.float16)
    slots = rng.permutation(n_pages + 2)[:n_pages]
    q = rng.standard_normal((2, h_a, d)).astype(np.float16)              # row 1: the split-marked sequence
    k, v = (rng.standard_normal((2, h_kv, d)).astype(np.float16) for _ in range(2))
    step = np.array([n, t_begin], np.int32)
    fp, ip, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    page, row = divmod(n - 1, T)

    def pages_and_ptrs(poison: bool):
        pages = pool.copy()
        if poison:
            pages[slots[page], :, :, row] = np.nan
        return pages, np.array([pages.ctypes.data + int(s) * pages[0].nbytes for s in slots], np.int64)

    pages_a, ptrs_a = pages_and_ptrs(False)
    out_a = np.full((h_a, d), np.nan, np.float16)
    lib.run_append(fp(k[0].ctypes.data), fp(v[0].ctypes.data), fp(ptrs_a.ctypes.data), ip(T), ip(h_kv),
                   fp(step.ctypes.data))
    lib.run_short(fp(q[0].ctypes.data), fp(ptrs_a.ctypes.data), ip(T), fp(step.ctypes.data), ip(h_kv), f(0.3),
                  fp(out_a.ctypes.data))
    ref = reference(q[0], pages_a, slots, T, t_begin, n, 0.3)
    err = float(np.abs(out_a.astype(np.float64) - ref).max() / np.abs(ref).max())
    pages_b, ptrs_b = pages_and_ptrs(True)
    out_b = np.full((h_a, d), np.nan, np.float16)
    lib.set_reverse_blocks(1)
    lib.run_short_append(fp(q[0].ctypes.data), fp(k[0].ctypes.data), fp(v[0].ctypes.data), fp(ptrs_b.ctypes.data),
                         ip(T), fp(step.ctypes.data), ip(h_kv), f(0.3), fp(out_b.ctypes.data))
    pages_c, ptrs_c = pages_and_ptrs(True)
    other_pages, other_ptrs = pages_and_ptrs(True)
    table = np.zeros((2, len(SEQ_FIELDS)), np.int64)
    table[0, :2] = ptrs_c.ctypes.data, step.ctypes.data                  # n_splits 0: the short kernel's
    table[1, :2] = other_ptrs.ctypes.data, step.ctypes.data
    table[1, SEQ_FIELDS.index("n_splits")] = 1                           # the split kernel's: left alone
    out_c = np.zeros((2, h_a, d), np.float16)
    lib.run_short_append_batch(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), fp(table.ctypes.data), ip(T),
                               ip(h_kv), f(0.3), fp(out_c.ctypes.data), ip(2))
    lib.set_reverse_blocks(0)
    same = [np.array_equal(out_a.view(np.uint16), o.view(np.uint16)) for o in (out_b, out_c[0])]
    print(f"\nshort decode, h_kv={h_kv} group={group} d={d} T={T} n={n} t_begin={t_begin}: max relative error "
          f"{err:.2e}; append and batch bits equal {same}")
    assert err < 1e-3                                                     # the output is fp16
    assert all(same) and np.array_equal(pages_b, pages_a) and np.array_equal(pages_c, pages_a)
    assert not out_c[1].any() and np.isnan(other_pages[slots[page], :, :, row]).all()
