"""flash_prefill's own CUDA source (schedules/gpu/flash_prefill.py), run on the CPU: one std::thread per CUDA thread.

The harness of test_paged_attention_cuda_emulated.py (threads, barriers, shuffles) plus the warp-collective PTX
the kernel uses, emulated from PTX ISA's documented fragment layouts: ldmatrix .x4 (and .trans) hands thread
l of a warp row l/4, columns 2(l%4) and 2(l%4)+1 of each 8x8 matrix whose rows the warp's threads 8i..8i+7
addressed; mma.m16n8k16 takes A (16x16, row) as a0..a3 = (rows g, g+8) x (cols 2t.., 8+2t..), B (16x8, col)
as b0, b1 = rows 2t.., 8+2t.. of column g, and C as c0..c3 = (row g, g+8) x (cols 2t, 2t+1), with g = l/4,
t = l%4. cp.async is a copy. This checks the kernel's tiling, masks, online softmax and fragment plumbing on a
machine without a GPU; tests/kernels/test_flash_prefill_gpu.py runs the same source on the GPU.
Reference: causal (windowed) softmax attention in float64 over the same fp16 inputs. Skipped without g++.
"""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from helmc.runtime.kv.paged_attention import full_attention
from helmc.schedules.gpu.flash_prefill import FLASH_SOURCE
from helmc.schedules.gpu.paged_attention import DECODE_SOURCE
from test_paged_attention_cuda_emulated import HARNESS

PTX = r"""
#define __align__(x) __attribute__((aligned(x)))
static const unsigned short* ldsm_rows[64][32];
static unsigned mma_a[64][32][4], mma_b[64][32][2];
static inline int warp_of() { return threadIdx.x >> 5; }
static inline int lane_of() { return threadIdx.x & 31; }
void ldsm_x4(unsigned* r, const unsigned short* p) {
    int w = warp_of(), l = lane_of();
    warp_barrier[w]->arrive_and_wait();
    ldsm_rows[w][l] = p;
    warp_barrier[w]->arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        const unsigned short* row = ldsm_rows[w][8 * i + (l >> 2)];
        r[i] = (unsigned)row[2 * (l & 3)] | ((unsigned)row[2 * (l & 3) + 1] << 16);
    }
}
void ldsm_x4_t(unsigned* r, const unsigned short* p) {
    int w = warp_of(), l = lane_of();
    warp_barrier[w]->arrive_and_wait();
    ldsm_rows[w][l] = p;
    warp_barrier[w]->arrive_and_wait();
    for (int i = 0; i < 4; ++i)
        r[i] = (unsigned)ldsm_rows[w][8 * i + 2 * (l & 3)][l >> 2]
             | ((unsigned)ldsm_rows[w][8 * i + 2 * (l & 3) + 1][l >> 2] << 16);
}
static inline float half_of(unsigned word, int hi) { return h2f((unsigned short)(hi ? word >> 16 : word & 0xffffu)); }
void mma_16816(float* c, const unsigned* a, const unsigned* b) {
    int w = warp_of(), l = lane_of();
    warp_barrier[w]->arrive_and_wait();
    for (int i = 0; i < 4; ++i) mma_a[w][l][i] = a[i];
    mma_b[w][l][0] = b[0]; mma_b[w][l][1] = b[1];
    warp_barrier[w]->arrive_and_wait();
    int g = l >> 2, t = l & 3;
    for (int j = 0; j < 4; ++j) {
        int row = g + (j >= 2 ? 8 : 0), col = 2 * t + (j & 1);
        float acc = c[j];
        for (int kk = 0; kk < 16; ++kk) {
            float av = half_of(mma_a[w][(row % 8) * 4 + (kk % 8) / 2][(row >= 8) + 2 * (kk >= 8)], kk % 2);
            float bv = half_of(mma_b[w][col * 4 + (kk % 8) / 2][kk >= 8], kk % 2);
            acc += av * bv;
        }
        c[j] = acc;
    }
}
void cp_async16(unsigned short* dst, const unsigned short* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
void cp_async_commit() {}
float fast_exp2(float x) { return std::exp2(x); }
unsigned pack_h2(float lo, float hi) { return (unsigned)f2h(lo) | ((unsigned)f2h(hi) << 16); }
"""

DRIVER = r"""
static const float* sinks = nullptr;    // the `sinks` both run_* pass the kernel ([h_a] fp32; null: none)
extern "C" void set_sinks(const float* s) { sinks = s; }
template <class F> static void launch(int gx, int gy, int threads, F body) {
    for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) {
        std::barrier<> bb(threads);
        block_barrier = &bb;
        std::vector<std::barrier<>*> wbs;
        for (int w = 0; w < threads / 32; ++w) wbs.push_back(warp_barrier[w] = new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
            threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; body(); });
        for (auto& th : ts) th.join();
        for (auto* b : wbs) delete b;
    }
}
extern "C" void run_flash(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                          long long head_stride, int n_q, int n_k, int q_pos0, int h_kv, int window, float scale,
                          unsigned short* out, const long long* page_ptrs, int page_tokens, int paged_keys) {
    launch((n_q + 63) / 64, h_kv * GROUP, 128, [&] {
        flash_prefill_v3(q, k, v, head_stride, n_q, n_k, q_pos0, h_kv, window, scale, out, page_ptrs, page_tokens,
                      paged_keys, 0, nullptr, 0, 0, sinks); });
}
extern "C" void run_flash_state(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                long long head_stride, int n_q, int n_k, int q_pos0, int h_kv, int window, float scale,
                                unsigned short* out, int k_pos0, float* state, int state_in, int state_out) {
    launch((n_q + 63) / 64, h_kv * GROUP, 128, [&] {
        flash_prefill_v3(q, k, v, head_stride, n_q, n_k, q_pos0, h_kv, window, scale, out, nullptr, 0, 0, k_pos0,
                      state, state_in, state_out, sinks); });
}
"""


_LIBS: dict = {}     # (head_dim, group) -> its library: each variant is compiled once per session (g++ takes seconds)


def build(tmp_path, head_dim, group):
    if (head_dim, group) not in _LIBS:
        src = tmp_path / f"flash_{head_dim}_{group}.cpp"
        src.write_text(HARNESS + PTX + DECODE_SOURCE + FLASH_SOURCE + DRIVER)
        lib = tmp_path / f"flash_{head_dim}_{group}.so"
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-DHEAD_DIM={head_dim}",
                        f"-DGROUP={group}", "-DHELMC_CPU_EMULATION", str(src), "-o", str(lib)], check=True)
        _LIBS[(head_dim, group)] = ctypes.CDLL(str(lib))
    return _LIBS[(head_dim, group)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("h_kv,group,d,cap,n_q,q_pos0,window,page_tokens", [
    (2, 4, 128, 100, 100, 0, 0, 0),     # a fresh prompt, the last query block and key tile partly filled
    (1, 2, 64, 200, 70, 80, 0, 0),      # a later chunk: queries at 80..149 over keys 0..149 of a 200-row scratch
    (2, 1, 32, 130, 130, 0, 40, 0),     # a sliding window: early key tiles skipped, the window's edge masked
    (1, 3, 16, 64, 64, 0, 0, 0),        # one 16-dim k-step, a group of 3
    (2, 2, 32, 70, 70, 192, 0, 128),    # a GPU-stage chunk: keys 0..191 in shuffled pages of 128, then its own 70
    (1, 2, 32, 64, 64, 256, 100, 64),   # the same with a window: the first pages skipped, the edge in a page
    (1, 2, 256, 80, 80, 0, 30, 0),      # Gemma 3's head_dim 256 (tiles past 48 KB of shared memory), a window
])
def test_flash_prefill_on_cpu_threads(tmp_path, h_kv, group, d, cap, n_q, q_pos0, window, page_tokens):
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(d + n_q)
    h_a, n_k = h_kv * group, q_pos0 + n_q
    paged = q_pos0 if page_tokens else 0                                     # keys before the chunk's own in pages
    q = (rng.standard_normal((n_q, h_a, d)) * 2).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, cap, d)).astype(np.float16)          # [2, h_kv, cap, d]: rows past n_k unused
    kv[:, :, n_k - paged:] = np.float16(np.nan)                              # never read: would poison the sums
    n_pages = -(-paged // page_tokens) if page_tokens else 0
    pool = rng.standard_normal((n_pages + 2, 2, h_kv, max(page_tokens, 1), d)).astype(np.float16)
    slots = rng.permutation(n_pages + 2)[:n_pages]
    ptrs = np.array([pool.ctypes.data + int(i) * pool[0].nbytes for i in slots] or [0], np.int64)
    out = np.full((n_q, h_a, d), np.nan, np.float16)
    fp, ip = ctypes.c_void_p, ctypes.c_int
    scale = 1.0 / np.sqrt(d)
    lib.run_flash(fp(q.ctypes.data), fp(kv[0].ctypes.data), fp(kv[1].ctypes.data), ctypes.c_longlong(cap * d),
                  ip(n_q), ip(n_k), ip(q_pos0), ip(h_kv), ip(window), ctypes.c_float(scale), fp(out.ctypes.data),
                  fp(ptrs.ctypes.data), ip(page_tokens), ip(paged))
    # every key in position order: the pages' rows, then the contiguous rows
    keys = [np.concatenate([pool[slots, w].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :paged], kv[w]], axis=1)
            for w in (0, 1)]                                                  # [h_kv, paged + cap, d] each
    ref = full_attention(q, *(x.transpose(1, 0, 2)[:n_k] for x in keys), scale, q_pos0, window)
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    print(f"\nflash_prefill on CPU threads, h_kv={h_kv} group={group} d={d} n_q={n_q} q_pos0={q_pos0} "
          f"window={window} page_tokens={page_tokens}: max relative error {err:.2e}")
    assert not np.isnan(out).any()
    assert err < 4e-3               # P is rounded to fp16 before P V (as FlashAttention does): ~2^-11 per weight


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("window", [0, 90])
def test_flash_prefill_carries_its_state_across_key_ranges(tmp_path, window):
    """Keys in three launches (positions 0..127, 128..255, then the chunk's own 256..319), the softmax state
    (o unnormalised, m, l) carried in a float32 buffer between them: the last launch's output is attention over
    all keys. With a window the first range is past every row's window: it leaves the state as it found it."""
    h_kv, group, d, n_q, q_pos0 = 2, 2, 32, 64, 256
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(window + 5)
    h_a, n_k = h_kv * group, q_pos0 + n_q
    q = (rng.standard_normal((n_q, h_a, d)) * 2).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, n_k, d)).astype(np.float16)           # every key, in position order
    out = np.full((n_q, h_a, d), np.nan, np.float16)
    state = np.full((n_q, h_a, d + 2), np.nan, np.float32)
    fp, ip = ctypes.c_void_p, ctypes.c_int
    scale = 1.0 / np.sqrt(d)
    for i, (a, b) in enumerate(((0, 128), (128, 256), (256, 320))):
        k, v = np.ascontiguousarray(kv[0, :, a:b]), np.ascontiguousarray(kv[1, :, a:b])   # [h_kv, b - a, d]
        lib.run_flash_state(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), ctypes.c_longlong((b - a) * d),
                            ip(n_q), ip(b - a), ip(q_pos0), ip(h_kv), ip(window), ctypes.c_float(scale),
                            fp(out.ctypes.data), ip(a), fp(state.ctypes.data), ip(i > 0), ip(i < 2))
    ref = full_attention(q, *(x.transpose(1, 0, 2)[:n_k] for x in kv), scale, q_pos0, window)
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    print(f"\nflash_prefill over 3 key ranges with its state carried, window={window}: max relative error {err:.2e}")
    assert not np.isnan(out).any() and err < 4e-3
