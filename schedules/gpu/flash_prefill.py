"""CUDA side of prefill attention on tensor cores: a flash-attention (FA2) kernel for fresh keys.

  flash_prefill_v3  grid (ceil(n_q / 64), h_a), 128 threads. Block (x, h) takes query rows 64x.. of head h, at
                  positions q_pos0 + row, and walks their visible keys (causal, and a sliding window when one
                  is set) 64 at a time: S = Q K^T with mma.sync m16n8k16 (fp16 in, fp32 sums), an online
                  softmax in fp32 on the accumulators, P rounded to fp16 and O += P V with the same mma.
                  Each warp owns 16 query rows; Q stays in registers, K and V tiles come into shared memory
                  by cp.async (the next K tile loads while P V runs, the next V tile while the next S runs).
                  Keys 0..n_k-1: key t < paged_keys in page page_ptrs[t / page_tokens] (a layer's slice of the
                  GPU cache's page, [2, h_kv, page_tokens, HEAD_DIM]; both multiples of 64, so a tile never
                  straddles pages), key t >= paged_keys at row t - paged_keys of KV head j at
                  k + j * kv_head_stride (the same for v). So the streamed prefill's [2, h_kv, S, d] scratch
                  (paged_keys 0, n_k = the rows written so far), a fresh prompt's K/V, and a later chunk of the
                  GPU stage (its earlier keys in device pages) are read where they lie. q, out [n_q, h_a, d].
                  Key t sits at position k_pos0 + t; `state` [n_q, h_a, d + 2] fp32 (o unnormalised, m, l)
                  carries the online softmax between launches over consecutive key ranges (state_in reads it
                  first, state_out writes it instead of out): a chunk whose earlier keys sit in host pages runs
                  a launch per staged group of them (runtime/kv/prefill_gpu.py).
                  sinks [h_a] fp32 (gpt-oss's attention sinks: a logit per head in the denominator; nullptr:
                  none, the arithmetic unchanged), the last argument: a launch that does not read the state
                  (state_in 0) starts each row's softmax from its head's sink (m = sink, l = 1, o = 0, as
                  runtime/kv/paged_attention.py); a launch reading it finds the sink already in, so a chunk's
                  launches count it once. A cubin built before the argument ignores it (only models without
                  sinks were built for the GPU then).

It replaces CuPy's fp32 score tiles (runtime/kv/paged_attention.attend_blocks), which at a 32K prompt ran
tens of element-wise kernels over every score: most of the prompt's 75 s. Needs sm_80+ (cp.async,
mma.m16n8k16); the source compiles to nothing below, and the runtime keeps the tiles there.
Built into the bundle's paged attention cubin beside the decode kernels (compile_gpu_stage.compile_paged_attention,
same -DHEAD_DIM/-DGROUP). tests/kernels/test_flash_prefill_emulated.py runs this source on CPU threads with the
PTX instructions emulated by their documented fragment layouts.
"""
from __future__ import annotations

# The symbol names the argument list: a cubin built with another list lacks it, so the runtime falls back to the
# older paths instead of calling it with the wrong arguments (v2: k_pos0 and the carried state; v3: its K and V tiles
# in dynamic shared memory, smem_bytes(head_dim) of it at each launch).
KERNEL_NAME = "flash_prefill_v3"
BLOCK_Q = 64                     # query rows per block (16 per warp)
BLOCK_K = 64                     # keys per tile
THREADS = 128


def smem_bytes(head_dim: int) -> int:
    """The dynamic shared memory of a launch: the K and V tiles, BLOCK_K rows of head_dim + 8 halves each."""
    return 2 * BLOCK_K * (head_dim + 8) * 2


def flash_supported(head_dim: int) -> bool:
    """Whether flash_prefill is built for this head_dim (fragments of 16 dims; the decode kernels need 32)."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256


FLASH_SOURCE = r"""
#if defined(HELMC_CPU_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define FQ 64                       // query rows per block
#define FK 64                       // keys per tile
#define FLDS (HEAD_DIM + 8)         // shared row in halves: 16 bytes of padding put ldmatrix's 8 rows on 8 bank groups
#define FKSTEPS (HEAD_DIM / 16)     // k16 steps of Q K^T
#define FDTILES (HEAD_DIM / 8)      // n8 tiles of O
#define FCHUNKS (FK * HEAD_DIM / 8 / 128)   // 16-byte pieces of a tile per thread

#ifdef HELMC_CPU_EMULATION          // warp-collective PTX, emulated by the test harness
void ldsm_x4(unsigned* r, const unsigned short* p);
void ldsm_x4_t(unsigned* r, const unsigned short* p);
void mma_16816(float* c, const unsigned* a, const unsigned* b);
void cp_async16(unsigned short* dst, const unsigned short* src, bool valid);
void cp_async_commit();
template <int N> void cp_async_wait() {}
float fast_exp2(float x);
unsigned pack_h2(float lo, float hi);
#else
__device__ __forceinline__ void ldsm_x4(unsigned* r, const unsigned short* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const unsigned short* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// c[4] += A (16x16, row) B (16x8, col): fp16 in, fp32 sums
__device__ __forceinline__ void mma_16816(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// 16 bytes global -> shared, zero-filled when !valid (src is then not read)
__device__ __forceinline__ void cp_async16(unsigned short* dst, const unsigned short* src, bool valid) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(a), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
    return (unsigned)f2h(lo) | ((unsigned)f2h(hi) << 16);
}
#endif

// Key rows t0.. of one (K or V) head `slice_head` of the page slice [2, h_kv, page_tokens, d] holding key t0
// when t0 < paged_keys, else rows t0 - paged_keys of `base` (that head's contiguous rows).
__device__ __forceinline__ const unsigned short* tile_rows(const unsigned short* base, const long long* page_ptrs,
                                                           int page_tokens, int paged_keys, int slice_head, int t0) {
    if (t0 < paged_keys)
        return reinterpret_cast<const unsigned short*>(page_ptrs[t0 / page_tokens])
               + ((long long)slice_head * page_tokens + t0 % page_tokens) * HEAD_DIM;
    return base + (long long)(t0 - paged_keys) * HEAD_DIM;
}

// rows [row0, row0 + FK) of a [*, HEAD_DIM] matrix with `stride` halves between rows -> s[FK][FLDS];
// rows at or past `limit` read as zeros.
__device__ __forceinline__ void load_tile(unsigned short* s, const unsigned short* g, long long stride, int row0,
                                          int limit, int tid) {
#pragma unroll
    for (int i = 0; i < FCHUNKS; ++i) {
        const int c = tid + i * 128, row = c / (HEAD_DIM / 8), col = (c % (HEAD_DIM / 8)) * 8;
        const bool valid = row0 + row < limit;
        cp_async16(s + row * FLDS + col, valid ? g + (long long)(row0 + row) * stride + col : g, valid);
    }
}

extern "C" __global__ void __launch_bounds__(128)
flash_prefill_v3(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
              const unsigned short* __restrict__ v, long long kv_head_stride, int n_q, int n_k, int q_pos0,
              int num_kv_heads, int window, float scale, unsigned short* __restrict__ out,
              const long long* __restrict__ page_ptrs, int page_tokens, int paged_keys, int k_pos0,
              float* __restrict__ state, int state_in, int state_out, const float* __restrict__ sinks)
{
#ifdef HELMC_CPU_EMULATION
    __shared__ __align__(16) unsigned short smem[2 * FK * FLDS];
#else
    // dynamic: 2 * FK * FLDS halves are 66 KB at HEAD_DIM 256, past the 48 KB of static shared memory (the
    // runtime opts the function in to FLASH_SMEM_BYTES with cuFuncSetAttribute)
    extern __shared__ __align__(16) unsigned short smem[];
#endif
    unsigned short* sK = smem;                                  // the Q tile first, then key tiles
    unsigned short* sV = smem + FK * FLDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int head = blockIdx.y, num_heads = num_kv_heads * GROUP;
    const int r0 = blockIdx.x * FQ;
    const long long q_stride = (long long)num_heads * HEAD_DIM;
    const int kvh = head / GROUP;
    const unsigned short* kh = k + (long long)kvh * kv_head_stride;
    const unsigned short* vh = v + (long long)kvh * kv_head_stride;

    // Q: rows r0.. of this head through shared memory into A fragments (row-major 16x16 per k16 step)
    load_tile(sK, q + (long long)r0 * q_stride + head * HEAD_DIM, q_stride, 0, n_q - r0, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned qa[FKSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < FKSTEPS; ++ks)
        ldsm_x4(qa[ks], sK + (warp * 16 + (lane & 15)) * FLDS + ks * 16 + (lane >> 4) * 8);
    __syncthreads();

    // Keys [t_begin, t_end) (this launch's rows; key t at position k_pos0 + t) are seen by some row of the block;
    // a thread's two rows are at positions p0, p0 + 8.
    const int p_lo = q_pos0 + r0, p_hi = q_pos0 + min(r0 + FQ, n_q) - 1;
    const int t_begin = max(0, (window > 0 ? p_lo - window + 1 : 0) - k_pos0) / FK * FK;
    const int t_end = min(n_k, p_hi + 1 - k_pos0);
    const int p0 = q_pos0 + r0 + warp * 16 + (lane >> 2);
    const float sl2 = scale * 1.4426950408889634f;             // scores in log2 units: exp2 in the softmax
    float m_run[2] = {-1e30f, -1e30f}, l_run[2] = {0.f, 0.f};  // finite start: a row with no key yet stays NaN-free
    if (sinks != nullptr && !state_in) {                        // the sink first (log2 units); l in one lane of the quad
        m_run[0] = m_run[1] = sinks[head] * 1.4426950408889634f;
        l_run[0] = l_run[1] = (lane & 3) == 0 ? 1.f : 0.f;
    }
    float o[FDTILES][4];
#pragma unroll
    for (int i = 0; i < FDTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    // state [n_q, h_a, HEAD_DIM + 2] fp32: a row's unnormalised o, then m and l, carried between launches over
    // consecutive key ranges (pages staged group by group); l enters in one lane of the quad (lanes sum at the end)
    if (state_in) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = r0 + warp * 16 + (lane >> 2) + hr * 8;
            if (r < n_q) {
                const float* st = state + ((long long)r * num_heads + head) * (HEAD_DIM + 2);
#pragma unroll
                for (int i = 0; i < FDTILES; ++i) {
                    o[i][hr * 2] = st[i * 8 + (lane & 3) * 2];
                    o[i][hr * 2 + 1] = st[i * 8 + (lane & 3) * 2 + 1];
                }
                m_run[hr] = st[HEAD_DIM];
                l_run[hr] = (lane & 3) == 0 ? st[HEAD_DIM + 1] : 0.f;
            }
        }
    }

    load_tile(sK, tile_rows(kh, page_ptrs, page_tokens, paged_keys, kvh, t_begin), HEAD_DIM, 0, n_k - t_begin, tid);
    cp_async_commit();
    load_tile(sV, tile_rows(vh, page_ptrs, page_tokens, paged_keys, num_kv_heads + kvh, t_begin), HEAD_DIM, 0,
              n_k - t_begin, tid);
    cp_async_commit();
    for (int t0 = t_begin; t0 < t_end; t0 += FK) {
        cp_async_wait<1>();                                      // this K tile (this V tile may still land)
        __syncthreads();
        float s[FK / 8][4];
#pragma unroll
        for (int i = 0; i < FK / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < FKSTEPS; ++ks) {
#pragma unroll
            for (int n2 = 0; n2 < FK / 16; ++n2) {               // keys n2*16 .. +15: two n8 tiles
                unsigned b[4];
                ldsm_x4(b, sK + (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * FLDS + ks * 16 + ((lane >> 3) & 1) * 8);
                mma_16816(s[2 * n2], qa[ks], b);
                mma_16816(s[2 * n2 + 1], qa[ks], b + 2);
            }
        }
        __syncthreads();                                         // every warp is done with this K tile
        if (t0 + FK < t_end)
            load_tile(sK, tile_rows(kh, page_ptrs, page_tokens, paged_keys, kvh, t0 + FK), HEAD_DIM, 0, n_k - t0 - FK, tid);
        cp_async_commit();

        // mask where some (row, key) of the block is not visible: the diagonal, the window's edge, past n_k
        const bool edge = k_pos0 + t0 + FK - 1 > p_lo || t0 + FK > n_k || (window > 0 && k_pos0 + t0 <= p_hi - window);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int p = p0 + hr * 8;
            float mx = m_run[hr];
#pragma unroll
            for (int i = 0; i < FK / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = t0 + i * 8 + (lane & 3) * 2 + e, tp = k_pos0 + t;
                    float x = s[i][hr * 2 + e] * sl2;
                    if (edge && (t >= n_k || tp > p || (window > 0 && tp <= p - window))) x = NEG_INF;
                    s[i][hr * 2 + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float alpha = fast_exp2(m_run[hr] - mx);
            m_run[hr] = mx;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < FK / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float w = fast_exp2(s[i][hr * 2 + e] - mx);
                    s[i][hr * 2 + e] = w;
                    sum += w;
                }
            l_run[hr] = l_run[hr] * alpha + sum;                 // this thread's share of the row; summed at the end
#pragma unroll
            for (int i = 0; i < FDTILES; ++i) { o[i][hr * 2] *= alpha; o[i][hr * 2 + 1] *= alpha; }
        }

        cp_async_wait<1>();                                      // this V tile (the next K tile may still land)
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < FK / 16; ++kk) {                   // keys kk*16 .. +15: P's accumulators are A's fragment
            const unsigned pa[4] = {pack_h2(s[2 * kk][0], s[2 * kk][1]), pack_h2(s[2 * kk][2], s[2 * kk][3]),
                                    pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int d2 = 0; d2 < FDTILES / 2; ++d2) {           // dims d2*16 .. +15: two n8 tiles of O
                unsigned b[4];
                ldsm_x4_t(b, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * FLDS + d2 * 16 + (lane >> 4) * 8);
                mma_16816(o[2 * d2], pa, b);
                mma_16816(o[2 * d2 + 1], pa, b + 2);
            }
        }
        __syncthreads();                                         // every warp is done with this V tile
        if (t0 + FK < t_end)
            load_tile(sV, tile_rows(vh, page_ptrs, page_tokens, paged_keys, num_kv_heads + kvh, t0 + FK), HEAD_DIM, 0,
                      n_k - t0 - FK, tid);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float l = l_run[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = r0 + warp * 16 + (lane >> 2) + hr * 8;
        if (r < n_q && state_out) {
            float* st = state + ((long long)r * num_heads + head) * (HEAD_DIM + 2);
#pragma unroll
            for (int i = 0; i < FDTILES; ++i) {
                st[i * 8 + (lane & 3) * 2] = o[i][hr * 2];
                st[i * 8 + (lane & 3) * 2 + 1] = o[i][hr * 2 + 1];
            }
            if ((lane & 3) == 0) { st[HEAD_DIM] = m_run[hr]; st[HEAD_DIM + 1] = l; }
        } else if (r < n_q) {
            const float inv = 1.f / l;
            unsigned* dst = reinterpret_cast<unsigned*>(out + (long long)r * q_stride + head * HEAD_DIM + (lane & 3) * 2);
#pragma unroll
            for (int i = 0; i < FDTILES; ++i) dst[i * 4] = pack_h2(o[i][hr * 2] * inv, o[i][hr * 2 + 1] * inv);
        }
    }
}
#endif
"""
