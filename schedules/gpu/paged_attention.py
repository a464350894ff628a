"""CUDA side of streaming paged attention: the decode kernels' source.

Decode attention (one query row per head) over a page table, split-K over pages:
  paged_decode_partial  grid (h_kv, splits): block (kv head j, split i) reads tokens [i*span, (i+1)*span)
                        (p whole pages, or 1/c of one page at short contexts) for the GROUP query heads sharing KV head j, with the online
                        softmax of eqs. 4.18-4.20 per warp, merges its 4 warps, and writes (m, s, o)
                        unnormalised. fp16 K/V, fp32 accumulation. Pages are found through a table
                        of addresses, so a resident page (pool slot) and a prefetched one (staging
                        slot) are read by the same code: the split a page falls in, not where it
                        lives, decides the arithmetic, and offload does not change a single bit.
  paged_decode_merge    grid (h_a): combines splits [begin, end) into o = sum(a_i o_i) / sum(a_i s_i), fp16.
  paged_append_decode   grid (h_kv, 2): writes this step's K and V row of one layer into its page.
The decode step's token count and window start are read from device memory (`step`: [n_tokens, t_begin]),
not passed by value, so one captured CUDA graph of the whole decode step replays at every position of a
page table (runtime/gpu_session.py); the host writes `step` once per step.

Page layout per layer slice: [2 (K, V), h_kv, page_tokens, HEAD_DIM] fp16, rows contiguous.
This module holds the source and its compile-time constants only: `helmc build` compiles it with nvcc for the
model's (head_dim, group) and the GPU's arch into the bundle (compile_gpu_stage.compile_paged_attention), and
the runtime loads that cubin (runtime/kv/cuda_ops.py); nothing compiles CUDA at run time.
"""
from __future__ import annotations

from helmc.errors import HelmcError

WARPS = 4                        # warps per block of paged_decode_partial; the source #defines the same
KERNEL_NAMES = ("paged_decode_partial", "paged_decode_merge", "paged_append_decode")

DECODE_SOURCE = r"""
// Compile with -DHEAD_DIM=<d> -DGROUP=<h_a / h_kv>.  HEAD_DIM must be a multiple of 32 and <= 256.
#define WARPS 4
#define VEC (HEAD_DIM / 32)
#define NEG_INF __int_as_float(0xff800000)

#ifdef HELMC_CPU_EMULATION          // tests/kernels/test_paged_attention_cuda_emulated.py runs this source on threads
float h2f(unsigned short h);
unsigned short f2h(float f);
#else
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// VEC consecutive fp16 values starting at p (p aligned to VEC * 2 bytes) -> fp32.
__device__ __forceinline__ void load_row(const unsigned short* __restrict__ p, float* out) {
#if VEC == 8
    uint4 u = *reinterpret_cast<const uint4*>(p);
    unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { out[2 * i] = h2f(w[i] & 0xffffu); out[2 * i + 1] = h2f(w[i] >> 16); }
#elif VEC == 4
    uint2 u = *reinterpret_cast<const uint2*>(p);
    out[0] = h2f(u.x & 0xffffu); out[1] = h2f(u.x >> 16);
    out[2] = h2f(u.y & 0xffffu); out[3] = h2f(u.y >> 16);
#elif VEC == 2
    unsigned int u = *reinterpret_cast<const unsigned int*>(p);
    out[0] = h2f(u & 0xffffu); out[1] = h2f(u >> 16);
#else
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = h2f(p[i]);
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_decode_partial(const unsigned short* __restrict__ q,      // [h_kv * GROUP, HEAD_DIM] fp16
                     const long long* __restrict__ page_ptrs,   // [n_pages] address of each page's layer slice
                     int page_tokens, const int* __restrict__ step,   // [n_tokens, t_begin]
                     int split_tokens, int split_base, int num_kv_heads, float scale,
                     float* __restrict__ part_m,                // [splits, h_a]
                     float* __restrict__ part_s,                // [splits, h_a]
                     float* __restrict__ part_o)                // [splits, h_a, HEAD_DIM]
{
    const int kvh = blockIdx.x;
    const int split = split_base + blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int num_heads = num_kv_heads * GROUP;
    const int n_tokens = step[0], t_begin = step[1];
    const int span = split_tokens;                      // whole pages, or a page cut in equal parts
    const int t_end = min(n_tokens, (split + 1) * span);
    const int t_start = max(split * span, t_begin);

    float qr[GROUP][VEC], o[GROUP][VEC], m[GROUP], s[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = NEG_INF;
        s[g] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            qr[g][i] = h2f(q[(kvh * GROUP + g) * HEAD_DIM + lane * VEC + i]) * scale;
            o[g][i] = 0.f;
        }
    }
    const long long k_off = (long long)kvh * page_tokens * HEAD_DIM + lane * VEC;
    const long long v_off = (long long)num_kv_heads * page_tokens * HEAD_DIM;
    for (int t = t_start + warp; t < t_end; t += WARPS) {
        const int page = t / page_tokens;
        const unsigned short* kp = reinterpret_cast<const unsigned short*>(page_ptrs[page])
                                   + k_off + (long long)(t - page * page_tokens) * HEAD_DIM;
        float kf[VEC], vf[VEC];
        load_row(kp, kf);
        load_row(kp + v_off, vf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float e = 0.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) e = fmaf(qr[g][i], kf[i], e);
#pragma unroll
            for (int sh = 16; sh > 0; sh >>= 1) e += __shfl_xor_sync(0xffffffffu, e, sh);
            const float m_new = fmaxf(m[g], e);                 // eq. 4.18
            const float r = expf(m[g] - m_new);                 // 0 on the first token (m = -inf)
            const float w = expf(e - m_new);
            s[g] = s[g] * r + w;                                // eq. 4.19
#pragma unroll
            for (int i = 0; i < VEC; ++i) o[g][i] = o[g][i] * r + w * vf[i];   // eq. 4.20
            m[g] = m_new;
        }
    }

    __shared__ float sm_m[WARPS][GROUP], sm_s[WARPS][GROUP];
    __shared__ float sm_o[WARPS][GROUP][HEAD_DIM];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_s[warp][g] = s[g]; }
#pragma unroll
        for (int i = 0; i < VEC; ++i) sm_o[warp][g][lane * VEC + i] = o[g][i];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += WARPS * 32) {
        const int g = idx / HEAD_DIM, c = idx - g * HEAD_DIM;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w][g]);
        float S = 0.f, O = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float mw = sm_m[w][g];
                if (mw != NEG_INF) {
                    const float a = expf(mw - M);
                    S += a * sm_s[w][g];
                    O += a * sm_o[w][g][c];
                }
            }
        }
        const long long row = (long long)split * num_heads + kvh * GROUP + g;
        part_o[row * HEAD_DIM + c] = O;
        if (c == 0) { part_m[row] = M; part_s[row] = S; }
    }
}

extern "C" __global__ void
paged_decode_merge(const float* __restrict__ part_m, const float* __restrict__ part_s,
                   const float* __restrict__ part_o, int split_begin, int split_end, int num_heads,
                   unsigned short* __restrict__ out)            // [h_a, HEAD_DIM] fp16; grid h_a, block HEAD_DIM
{
    const int h = blockIdx.x, c = threadIdx.x;
    float M = NEG_INF;
    for (int sp = split_begin; sp < split_end; ++sp) M = fmaxf(M, part_m[(long long)sp * num_heads + h]);
    float S = 0.f, O = 0.f;
    for (int sp = split_begin; sp < split_end; ++sp) {
        const long long row = (long long)sp * num_heads + h;
        const float mm = part_m[row];
        if (mm != NEG_INF) {
            const float a = expf(mm - M);
            S += a * part_s[row];
            O += a * part_o[row * HEAD_DIM + c];
        }
    }
    out[h * HEAD_DIM + c] = f2h(O / S);
}

// One decode step's K and V rows of one layer ([h_kv, HEAD_DIM] fp16 each) into row step[0]-1 of their page.
extern "C" __global__ void
paged_append_decode(const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
                    const long long* __restrict__ page_ptrs, int page_tokens, int num_kv_heads,
                    const int* __restrict__ step)               // grid (h_kv, 2), block HEAD_DIM
{
    const int pos = step[0] - 1;
    const int page = pos / page_tokens, row = pos - page * page_tokens;
    const int h = blockIdx.x, which = blockIdx.y, c = threadIdx.x;
    const unsigned short* src = which == 0 ? k : v;
    unsigned short* dst = reinterpret_cast<unsigned short*>(page_ptrs[page]);
    dst[((long long)(which * num_kv_heads + h) * page_tokens + row) * HEAD_DIM + c] = src[h * HEAD_DIM + c];
}
"""


def kernel_defines(head_dim: int, group: int) -> tuple[str, ...]:
    if head_dim % 32 or not 32 <= head_dim <= 256:
        raise HelmcError(f"paged decode kernel: head_dim expected a multiple of 32 in 32..256, found {head_dim}")
    if not 1 <= group <= 16:
        raise HelmcError(f"paged decode kernel: query heads per KV head expected 1..16, found {group}")
    return (f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}")
