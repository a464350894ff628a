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
  paged_decode_fused    both in one launch when one launch covers the step's splits (every page on the device):
                        the last block of each KV head to finish merges that head's queries.
  paged_decode_fused_append  paged_append_decode and paged_decode_fused in one launch (the row is read from the
                        step's K/V, not its page, so no block waits for the write).
  paged_decode_fused_append_batch  paged_decode_fused_append for each sequence of a batched decode step (grid z:
                        the sequence, its page table, step and splits read from a table of its own): one launch a
                        layer for all sequences, each getting its one-sequence launch's bits.
  paged_append_decode   grid (h_kv, 2): writes this step's K and V row of one layer into its page.
  (paged_decode_short*  up to 1024 tokens of pages, one block per query head: paged_decode_short.py, compiled after
                        this source)
  prefill_causal        a fresh prompt's causal attention (no cached tokens): one warp per (query row, KV head)
                        walks keys 0..row with the same online softmax, for the GROUP heads of that KV head,
                        reading the step's own K/V [2, h_kv, S, HEAD_DIM]; one launch per layer where the
                        CuPy tiles of attend_blocks took ~20 (TTFT was launches, not FLOPs).
Attention sinks (gpt-oss: a logit per query head in the softmax's denominator, no value): every kernel that writes
an output takes `sinks` ([h_a] fp32, the layer's; nullptr: none, and then the arithmetic is exactly the one without
the argument), its last argument. The split family adds the sink once, in the merge (paged_decode_merge and the
fused kernels' last block): M' = max(M, sink), S' = e^(sink - M') + sum_i a_i s_i, before the splits; the partials
never see it, so a step's splits over any number of launches count it once. prefill_causal, one warp a row, starts
its state from it (m = sink, s = 1, o = 0), as runtime/kv/paged_attention.py does. A batched launch takes one
sinks pointer for every sequence (one layer's). A cubin built before the argument ignores it (a launch's parameters
are read by the kernel's own list); only models without sinks were built for the GPU then.
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
KERNEL_NAMES = ("paged_decode_partial", "paged_decode_merge", "paged_append_decode", "prefill_causal",
                "paged_decode_fused", "paged_decode_fused_append", "paged_decode_fused_append_batch")
# paged_decode_fused_append_batch's table row per sequence: int64 fields at these indices (the source #defines them)
SEQ_FIELDS = ("page_ptrs", "step", "part_m", "part_s", "part_o", "counters", "split_tokens", "split_base", "n_splits")

DECODE_SOURCE = r"""
// Compile with -DHEAD_DIM=<d> -DGROUP=<h_a / h_kv>.  HEAD_DIM must be a multiple of 32 and <= 256.
#define WARPS 4
#define LOOKAHEAD 4                 // tokens per warp whose K/V rows are in flight together
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

// static: its __shared__ arrays stay this library's own (the CPU emulation's inline statics would be one
// process-wide symbol across libraries built for other shapes)
static __device__ __forceinline__ void
decode_partial_body(const unsigned short* __restrict__ q,      // [h_kv * GROUP, HEAD_DIM] fp16
                    const long long* __restrict__ page_ptrs,   // [n_pages] address of each page's layer slice
                    int page_tokens, const int* __restrict__ step,   // [n_tokens, t_begin]
                    int split_tokens, int split_base, int num_kv_heads, float scale,
                    float* __restrict__ part_m,                // [splits, h_a]
                    float* __restrict__ part_s,                // [splits, h_a]
                    float* __restrict__ part_o,                // [splits, h_a, HEAD_DIM]
                    const unsigned short* __restrict__ k_new,  // [h_kv, HEAD_DIM] token n-1's K, V; nullptr: from
                    const unsigned short* __restrict__ v_new)  // its page (paged_decode_fused_append passes them)
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
    // A warp's tokens t_start + warp, + WARPS, ... in that order; LOOKAHEAD of them are loaded (page addresses,
    // then K and V rows) before any is used, so their memory latencies overlap instead of adding up. Same order
    // of operations as one token at a time: the same bits.
    for (int t0 = t_start + warp; t0 < t_end; t0 += WARPS * LOOKAHEAD) {
        // Straight-line loads: the page addresses first, then the rows (a token past t_end loads token t_end - 1,
        // unused), so no branch keeps a load from being issued before the one ahead of it returns.
        float kf[LOOKAHEAD][VEC], vf[LOOKAHEAD][VEC];
        long long pg[LOOKAHEAD];
#pragma unroll
        for (int u = 0; u < LOOKAHEAD; ++u) pg[u] = page_ptrs[min(t0 + u * WARPS, t_end - 1) / page_tokens];
#pragma unroll
        for (int u = 0; u < LOOKAHEAD; ++u) {
            const int t = min(t0 + u * WARPS, t_end - 1), page = t / page_tokens;
            const bool fresh = k_new != nullptr && t == n_tokens - 1;   // this step's row: the same fp16 values as
            const unsigned short* kp = fresh ? k_new + kvh * HEAD_DIM + lane * VEC     // the page will hold
                : reinterpret_cast<const unsigned short*>(pg[u]) + k_off + (long long)(t - page * page_tokens) * HEAD_DIM;
            load_row(kp, kf[u]);
            load_row(fresh ? v_new + kvh * HEAD_DIM + lane * VEC : kp + v_off, vf[u]);
        }
#pragma unroll
        for (int u = 0; u < LOOKAHEAD; ++u) {
            if (t0 + u * WARPS >= t_end) break;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float e = 0.f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) e = fmaf(qr[g][i], kf[u][i], e);
#pragma unroll
                for (int sh = 16; sh > 0; sh >>= 1) e += __shfl_xor_sync(0xffffffffu, e, sh);
                const float m_new = fmaxf(m[g], e);                 // eq. 4.18
                const float r = expf(m[g] - m_new);                 // 0 on the first token (m = -inf)
                const float w = expf(e - m_new);
                s[g] = s[g] * r + w;                                // eq. 4.19
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[g][i] = o[g][i] * r + w * vf[u][i];   // eq. 4.20
                m[g] = m_new;
            }
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

extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_decode_partial(const unsigned short* __restrict__ q, const long long* __restrict__ page_ptrs,
                     int page_tokens, const int* __restrict__ step, int split_tokens, int split_base,
                     int num_kv_heads, float scale, float* __restrict__ part_m, float* __restrict__ part_s,
                     float* __restrict__ part_o)
{
    decode_partial_body(q, page_ptrs, page_tokens, step, split_tokens, split_base, num_kv_heads, scale,
                        part_m, part_s, part_o, nullptr, nullptr);
}

// Column c of head h's output from splits [split_begin, split_end): o = sum(a_i o_i) / sum(a_i s_i). Loads through
// L2 (__ldcg): in paged_decode_fused another SM wrote the partials during this kernel, and this SM's L1 may hold
// a line of them read before (a line spans heads of several KV heads).
__device__ __forceinline__ void merge_column(const float* part_m, const float* part_s, const float* part_o,
                                             int split_begin, int split_end, int num_heads, int h, int c,
                                             unsigned short* __restrict__ out, const float* __restrict__ sinks)
{
    float M = NEG_INF;
    for (int sp = split_begin; sp < split_end; ++sp) M = fmaxf(M, __ldcg(part_m + (long long)sp * num_heads + h));
    if (sinks != nullptr) M = fmaxf(M, sinks[h]);       // the sink joins the denominator once, here
    float S = sinks != nullptr ? expf(sinks[h] - M) : 0.f, O = 0.f;
    for (int sp = split_begin; sp < split_end; ++sp) {
        const long long row = (long long)sp * num_heads + h;
        const float mm = __ldcg(part_m + row);
        if (mm != NEG_INF) {
            const float a = expf(mm - M);
            S += a * __ldcg(part_s + row);
            O += a * __ldcg(part_o + row * HEAD_DIM + c);
        }
    }
    out[h * HEAD_DIM + c] = f2h(O / S);
}

extern "C" __global__ void
paged_decode_merge(const float* __restrict__ part_m, const float* __restrict__ part_s,
                   const float* __restrict__ part_o, int split_begin, int split_end, int num_heads,
                   unsigned short* __restrict__ out,            // [h_a, HEAD_DIM] fp16; grid h_a, block HEAD_DIM
                   const float* __restrict__ sinks)             // [h_a] fp32 or nullptr
{
    merge_column(part_m, part_s, part_o, split_begin, split_end, num_heads, blockIdx.x, threadIdx.x, out, sinks);
}

// paged_decode_partial over splits [split_base, split_base + n_splits) (all of the step's: grid (h_kv, n_splits)),
// then the merge in the same launch: the last block of KV head j to finish (a counter per KV head, left at 0 for
// the next launch, so a captured graph replays it) merges j's GROUP heads, one warp per head: the lanes read the
// splits' (m, s) at once, M is their max, each lane stages a = exp(m - M) and s of 32 splits in shared memory, and
// then adds the splits in order for its VEC columns: paged_decode_merge's operations in its order, so the same
// bits, without its chain of one dependent load per split. One kernel where there were two.
static __device__ __forceinline__ void
decode_fused_body(const unsigned short* __restrict__ q, const long long* __restrict__ page_ptrs,
                  int page_tokens, const int* __restrict__ step, int split_tokens, int split_base, int n_splits,
                  int num_kv_heads, float scale, float* __restrict__ part_m, float* __restrict__ part_s,
                  float* __restrict__ part_o, int* __restrict__ counters, unsigned short* __restrict__ out,
                  const unsigned short* __restrict__ k_new, const unsigned short* __restrict__ v_new,
                  const float* __restrict__ sinks)
{
    decode_partial_body(q, page_ptrs, page_tokens, step, split_tokens, split_base, num_kv_heads, scale,
                        part_m, part_s, part_o, k_new, v_new);
    __threadfence();                                   // this block's partials visible to the GPU before it counts
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == n_splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int kvh = blockIdx.x, num_heads = num_kv_heads * GROUP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int begin = split_base, end = split_base + n_splits;
    __shared__ float st_a[WARPS][32], st_s[WARPS][32];
    __shared__ int st_ok[WARPS][32];
    for (int g = warp; g < GROUP; g += WARPS) {        // warp-uniform: every lane of a warp takes the same heads
        const int h = kvh * GROUP + g;
        float M = NEG_INF;
        for (int sp = begin + lane; sp < end; sp += 32) M = fmaxf(M, __ldcg(part_m + (long long)sp * num_heads + h));
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, sh));   // max: exact
        if (sinks != nullptr) M = fmaxf(M, sinks[h]);   // as merge_column: the sink once, before the splits
        float S = sinks != nullptr ? expf(sinks[h] - M) : 0.f, O[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) O[i] = 0.f;
        for (int s0 = begin; s0 < end; s0 += 32) {
            const int sp = s0 + lane;
            if (sp < end) {
                const long long row = (long long)sp * num_heads + h;
                const float mm = __ldcg(part_m + row);
                st_ok[warp][lane] = mm != NEG_INF;
                st_a[warp][lane] = mm != NEG_INF ? expf(mm - M) : 0.f;
                st_s[warp][lane] = __ldcg(part_s + row);
            }
            __syncwarp();
            const int n = min(32, end - s0);
#pragma unroll 4
            for (int j = 0; j < n; ++j) {
                if (st_ok[warp][j]) {
                    const float a = st_a[warp][j];
                    const float* po = part_o + ((long long)(s0 + j) * num_heads + h) * HEAD_DIM + lane * VEC;
                    S += a * st_s[warp][j];
#pragma unroll
                    for (int i = 0; i < VEC; ++i) O[i] += a * __ldcg(po + i);
                }
            }
            __syncwarp();                                  // the stage is read before the next 32 splits' overwrite it
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[h * HEAD_DIM + lane * VEC + i] = f2h(O[i] / S);
    }
    if (threadIdx.x == 0) counters[kvh] = 0;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_decode_fused(const unsigned short* __restrict__ q, const long long* __restrict__ page_ptrs,
                   int page_tokens, const int* __restrict__ step, int split_tokens, int split_base, int n_splits,
                   int num_kv_heads, float scale, float* __restrict__ part_m, float* __restrict__ part_s,
                   float* __restrict__ part_o, int* __restrict__ counters,   // [h_kv] int32, 0 between launches
                   unsigned short* __restrict__ out,                          // [h_a, HEAD_DIM] fp16
                   const float* __restrict__ sinks)                           // [h_a] fp32 or nullptr
{
    decode_fused_body(q, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits, num_kv_heads, scale,
                      part_m, part_s, part_o, counters, out, nullptr, nullptr, sinks);
}

// Block (j, 0) of a launch of `threads` threads writes KV head j's row of this step (token step[0] - 1) into its page
// (the fused and short append kernels: their reads take that row from k_new / v_new, so none waits for the write).
__device__ __forceinline__ void append_step_row(const unsigned short* __restrict__ k_new,
                                                const unsigned short* __restrict__ v_new,
                                                const long long* __restrict__ page_ptrs, int page_tokens,
                                                const int* __restrict__ step, int num_kv_heads, int threads)
{
    if (blockIdx.y != 0) return;
    const int pos = step[0] - 1, page = pos / page_tokens, row = pos - page * page_tokens, h = blockIdx.x;
    unsigned short* dst = reinterpret_cast<unsigned short*>(page_ptrs[page]);
    for (int c = threadIdx.x; c < HEAD_DIM; c += threads) {
        dst[((long long)h * page_tokens + row) * HEAD_DIM + c] = k_new[h * HEAD_DIM + c];
        dst[((long long)(num_kv_heads + h) * page_tokens + row) * HEAD_DIM + c] = v_new[h * HEAD_DIM + c];
    }
}

// paged_append_decode and paged_decode_fused in one launch: block (j, 0) writes KV head j's row of this step (token
// n-1) into its page, and every block takes that token's K and V from k_new / v_new rather than the page, so no
// block waits for the write and none reads a half-written row. One kernel a layer where there were two.
static __device__ __forceinline__ void
decode_fused_append_body(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_new,
                         const unsigned short* __restrict__ v_new, const long long* __restrict__ page_ptrs,
                         int page_tokens, const int* __restrict__ step, int split_tokens, int split_base,
                         int n_splits, int num_kv_heads, float scale, float* __restrict__ part_m,
                         float* __restrict__ part_s, float* __restrict__ part_o, int* __restrict__ counters,
                         unsigned short* __restrict__ out, const float* __restrict__ sinks)
{
    append_step_row(k_new, v_new, page_ptrs, page_tokens, step, num_kv_heads, WARPS * 32);
    decode_fused_body(q, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits, num_kv_heads, scale,
                      part_m, part_s, part_o, counters, out, k_new, v_new, sinks);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_decode_fused_append(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_new,
                          const unsigned short* __restrict__ v_new, const long long* __restrict__ page_ptrs,
                          int page_tokens, const int* __restrict__ step, int split_tokens, int split_base,
                          int n_splits, int num_kv_heads, float scale, float* __restrict__ part_m,
                          float* __restrict__ part_s, float* __restrict__ part_o, int* __restrict__ counters,
                          unsigned short* __restrict__ out, const float* __restrict__ sinks)
{
    decode_fused_append_body(q, k_new, v_new, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits,
                             num_kv_heads, scale, part_m, part_s, part_o, counters, out, sinks);
}

// A batched decode step of one layer: sequence b (blockIdx.z) is paged_decode_fused_append's launch for that
// sequence alone -- rows b of q, k_new, v_new and out, and its own page table, step, splits, partials and counters
// from seqs[b] -- so each sequence gets that kernel's bits, in one launch for all of them. seqs[b]: SEQ_FIELDS
// int64 (SEQ_* below). grid (h_kv, max_b n_splits_b, B): the blocks past a sequence's splits return at once
// (before any barrier or count, so its counters still reach n_splits_b).
#define SEQ_PAGE_PTRS 0
#define SEQ_STEP 1
#define SEQ_PART_M 2
#define SEQ_PART_S 3
#define SEQ_PART_O 4
#define SEQ_COUNTERS 5
#define SEQ_SPLIT_TOKENS 6
#define SEQ_SPLIT_BASE 7
#define SEQ_N_SPLITS 8
#define SEQ_FIELDS 9
extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_decode_fused_append_batch(const unsigned short* __restrict__ q,       // [B, h_a, HEAD_DIM] fp16
                                const unsigned short* __restrict__ k_new,   // [B, h_kv, HEAD_DIM] fp16
                                const unsigned short* __restrict__ v_new,   // [B, h_kv, HEAD_DIM] fp16
                                const long long* __restrict__ seqs,         // [B, SEQ_FIELDS]
                                int page_tokens, int num_kv_heads, float scale,
                                unsigned short* __restrict__ out,           // [B, h_a, HEAD_DIM] fp16
                                const float* __restrict__ sinks)            // [h_a] fp32 (the layer's), or nullptr
{
    const long long* seq = seqs + (long long)blockIdx.z * SEQ_FIELDS;
    const int n_splits = (int)seq[SEQ_N_SPLITS];
    if ((int)blockIdx.y >= n_splits) return;
    const long long b = blockIdx.z, q_row = b * num_kv_heads * GROUP * HEAD_DIM, kv_row = b * num_kv_heads * HEAD_DIM;
    decode_fused_append_body(q + q_row, k_new + kv_row, v_new + kv_row,
                             reinterpret_cast<const long long*>(seq[SEQ_PAGE_PTRS]), page_tokens,
                             reinterpret_cast<const int*>(seq[SEQ_STEP]), (int)seq[SEQ_SPLIT_TOKENS],
                             (int)seq[SEQ_SPLIT_BASE], n_splits, num_kv_heads, scale,
                             reinterpret_cast<float*>(seq[SEQ_PART_M]), reinterpret_cast<float*>(seq[SEQ_PART_S]),
                             reinterpret_cast<float*>(seq[SEQ_PART_O]), reinterpret_cast<int*>(seq[SEQ_COUNTERS]),
                             out + q_row, sinks);
}

// Causal attention of S fresh query rows (positions 0..S-1) over the same rows' K/V; window > 0 keeps keys
// t > row - window. q, out [S, h_kv * GROUP, HEAD_DIM] fp16; kv [2, h_kv, S, HEAD_DIM] fp16.
// grid (ceil(S / WARPS), h_kv), block WARPS * 32: warp w of block x owns row x * WARPS + w. No block barrier,
// so a warp past the last row returns at once.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
prefill_causal(const unsigned short* __restrict__ q, const unsigned short* __restrict__ kv, int S,
               int num_kv_heads, int window, float scale, unsigned short* __restrict__ out,
               const float* __restrict__ sinks)             // [h_a] fp32 or nullptr
{
    const int kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * WARPS + warp;
    if (r >= S) return;
    const int num_heads = num_kv_heads * GROUP;
    float qr[GROUP][VEC], o[GROUP][VEC], m[GROUP], s[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = sinks != nullptr ? sinks[kvh * GROUP + g] : NEG_INF;   // the state starts from the sink
        s[g] = sinks != nullptr ? 1.f : 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            qr[g][i] = h2f(q[((long long)r * num_heads + kvh * GROUP + g) * HEAD_DIM + lane * VEC + i]) * scale;
            o[g][i] = 0.f;
        }
    }
    const unsigned short* kp = kv + (long long)kvh * S * HEAD_DIM + lane * VEC;
    const long long v_off = (long long)num_kv_heads * S * HEAD_DIM;
    for (int t = window > 0 ? max(0, r - window + 1) : 0; t <= r; ++t) {
        float kf[VEC], vf[VEC];
        load_row(kp + (long long)t * HEAD_DIM, kf);
        load_row(kp + v_off + (long long)t * HEAD_DIM, vf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float e = 0.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) e = fmaf(qr[g][i], kf[i], e);
#pragma unroll
            for (int sh = 16; sh > 0; sh >>= 1) e += __shfl_xor_sync(0xffffffffu, e, sh);
            const float m_new = fmaxf(m[g], e);
            const float a = expf(m[g] - m_new);
            const float w = expf(e - m_new);
            s[g] = s[g] * a + w;
#pragma unroll
            for (int i = 0; i < VEC; ++i) o[g][i] = o[g][i] * a + w * vf[i];
            m[g] = m_new;
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int i = 0; i < VEC; ++i)
            out[((long long)r * num_heads + kvh * GROUP + g) * HEAD_DIM + lane * VEC + i] = f2h(o[g][i] / s[g]);
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
