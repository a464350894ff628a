"""CUDA side of decode attention at short contexts: one thread block per query head, no split partials.

At a few hundred tokens the split kernels of paged_attention.py spend their time on latency, not bytes: a
Qwen3-8B layer's K/V at 190 tokens is 0.8 MB (0.3 us of HBM) and its fused split launch took 14.8 us (an Nsight
table): 16 splits of 32 tokens, each warp's online softmax over two dependent rounds of page loads, then
the partials through global memory, a fence, a counter and the last block's merge of 16 splits.

Here one block of SHORT_WARPS warps owns query head h and reads every token of its KV head (the 4 query heads of
a KV head share those rows through L2). HEAD_DIM / 8 lanes take one token row (16-byte loads); thread slot i takes
rows i, i + SHORT_SLOTS, ...; SHORT_UNROLL rows of K and of V per thread are loaded straight-line (the page
addresses first, then every row: a branch around a load kept the next one from issuing, 1.3-1.9x slower) before
any is used. Each row's score is reduced over its lanes with shuffles and folded into the slot's online softmax
(m, s, o; eqs. 4.18-4.20 as in the split kernels); the slots' states meet in shared memory, added in slot order,
and o = O / S is rounded to fp16 once. One round of loads at ~200 tokens, no global partials, no fence, no second
phase (H200: 5.2 us a layer at 190 tokens against the split kernel's 11.7).

  paged_decode_short          grid (h_kv, GROUP): the step's K/V row already in its page
  paged_decode_short_append   the row from k_new / v_new (block (j, 0) also writes it into its page), as
                              paged_decode_fused_append does, so no block waits for the write
  paged_decode_short_append_batch   grid (h_kv, GROUP, B): sequence b's short_append from its row of the batch
                              table (paged_attention.SEQ_FIELDS); sequences marked n_splits > 0 use the split
                              kernel and return here at once, so a batched step gives each sequence the bits of
                              its one-sequence launch
The window start and token count come from `step` in device memory, as in the split kernels, so one captured
graph replays at every position of a page layout; the host takes this path while the layout holds at most
decode_splits.SHORT_MAX_TOKENS tokens (runtime/kv/decode_splits.short_path), host pages staged first.
Attention sinks (`sinks`, [h_a] fp32 or nullptr, each kernel's last argument): slot 0's state starts from the
head's sink (m = sink, s = 1, o = 0), the other slots from nothing, so the slots' merge counts it once; without
sinks every slot starts empty, as before. The batch kernel takes one layer's sinks for every sequence.
Compiled after paged_attention.DECODE_SOURCE (it uses h2f / f2h, NEG_INF, append_step_row and the SEQ_* fields)
for head_dim in SHORT_HEAD_DIMS; other head sizes keep the split kernels.
"""
from __future__ import annotations

SHORT_HEAD_DIMS = (32, 64, 128, 256)   # HEAD_DIM / 8 lanes per row must be a power of two within a warp
KERNEL_NAMES = ("paged_decode_short", "paged_decode_short_append", "paged_decode_short_append_batch")

SHORT_SOURCE = r"""
#if HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256
#ifndef SHORT_WARPS
#define SHORT_WARPS 16
#endif
#ifndef SHORT_UNROLL
#define SHORT_UNROLL 4
#endif
#define SHORT_LPT (HEAD_DIM / 8)                         // lanes per token row, 8 fp16 (16 bytes) each
#define SHORT_SLOTS (SHORT_WARPS * 32 / SHORT_LPT)       // rows one pass of the block has in hand

__device__ __forceinline__ void unpack8(uint4 u, float* out) {
    unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { out[2 * i] = h2f(w[i] & 0xffffu); out[2 * i + 1] = h2f(w[i] >> 16); }
}

static __device__ __forceinline__ void
decode_short_body(const unsigned short* __restrict__ q,       // [h_kv * GROUP, HEAD_DIM] fp16
                  const long long* __restrict__ page_ptrs, int page_tokens,
                  const int* __restrict__ step,               // [n_tokens, t_begin]
                  int num_kv_heads, float scale, unsigned short* __restrict__ out,   // [h_a, HEAD_DIM] fp16
                  const unsigned short* __restrict__ k_new, const unsigned short* __restrict__ v_new,
                  const float* __restrict__ sinks)            // [h_a] fp32 or nullptr
{
    const int kvh = blockIdx.x, h = kvh * GROUP + blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31;
    const int sub = tid % SHORT_LPT, slot = tid / SHORT_LPT;
    const int n = step[0], t_begin = step[1], len = n - t_begin;
    const long long v_plane = (long long)num_kv_heads * page_tokens * HEAD_DIM;
    float qv[8];
    unpack8(*reinterpret_cast<const uint4*>(q + h * HEAD_DIM + sub * 8), qv);
#pragma unroll
    for (int i = 0; i < 8; ++i) qv[i] *= scale;

    // Slot `slot` takes rows slot, slot + SHORT_SLOTS, ... of the window; SHORT_UNROLL of them (K and V) are loaded
    // before any is used. `base` is the same for every thread, so every lane of a warp reaches every shuffle.
    const bool sink = sinks != nullptr && slot == 0;     // slot 0 starts from the sink: the merge counts it once
    float m = sink ? sinks[h] : NEG_INF, s = sink ? 1.f : 0.f, o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = 0.f;
    for (int base = 0; base < len; base += SHORT_SLOTS * SHORT_UNROLL) {
        // Straight-line loads (no branch around any): the page addresses first, then every row's K and V, so
        // all of them are in flight together; a row past the window loads the window's last row, unused.
        long long pg[SHORT_UNROLL];
        uint4 kr[SHORT_UNROLL], vr[SHORT_UNROLL];
#pragma unroll
        for (int u = 0; u < SHORT_UNROLL; ++u)
            pg[u] = page_ptrs[(t_begin + min(base + u * SHORT_SLOTS + slot, len - 1)) / page_tokens];
#pragma unroll
        for (int u = 0; u < SHORT_UNROLL; ++u) {
            const int t = t_begin + min(base + u * SHORT_SLOTS + slot, len - 1), page = t / page_tokens;
            const bool fresh = k_new != nullptr && t == n - 1;      // this step's row: the bits its page will hold
            const unsigned short* kp = fresh ? k_new + kvh * HEAD_DIM + sub * 8
                : reinterpret_cast<const unsigned short*>(pg[u])
                  + ((long long)kvh * page_tokens + (t - page * page_tokens)) * HEAD_DIM + sub * 8;
            const unsigned short* vp = fresh ? v_new + kvh * HEAD_DIM + sub * 8 : kp + v_plane;
            kr[u] = *reinterpret_cast<const uint4*>(kp);
            vr[u] = *reinterpret_cast<const uint4*>(vp);
        }
#pragma unroll
        for (int u = 0; u < SHORT_UNROLL; ++u) {
            float kf[8], vf[8], e = 0.f;
            unpack8(kr[u], kf);
            unpack8(vr[u], vf);
#pragma unroll
            for (int j = 0; j < 8; ++j) e = fmaf(qv[j], kf[j], e);
#pragma unroll
            for (int sh = SHORT_LPT / 2; sh > 0; sh >>= 1) e += __shfl_xor_sync(0xffffffffu, e, sh);
            if (base + u * SHORT_SLOTS + slot < len) {          // the same for a row's SHORT_LPT lanes
                const float m_new = fmaxf(m, e);                 // eqs. 4.18-4.20, as the split kernels
                const float r = expf(m - m_new);                 // 0 on the slot's first row (m = -inf)
                const float w = expf(e - m_new);
                s = s * r + w;
#pragma unroll
                for (int j = 0; j < 8; ++j) o[j] = o[j] * r + w * vf[j];
                m = m_new;
            }
        }
    }

    // the slots' (m, s, o) meet in shared memory: a_i = exp(m_i - M), O = sum a_i o_i, S = sum a_i s_i, in slot order
    __shared__ float sm_m[SHORT_SLOTS], sm_s[SHORT_SLOTS];
    __shared__ float sm_o[SHORT_SLOTS][HEAD_DIM];
    if (sub == 0) { sm_m[slot] = m; sm_s[slot] = s; }
#pragma unroll
    for (int j = 0; j < 8; ++j) sm_o[slot][sub * 8 + j] = o[j];
    __syncthreads();
    if (tid < 32) {                                       // warp 0: M, then each slot's a (0 for an empty slot)
        float M = NEG_INF;
        for (int i = lane; i < SHORT_SLOTS; i += 32) M = fmaxf(M, sm_m[i]);
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, sh));   // max: exact
        __syncwarp();                                     // every lane has read sm_m before it is overwritten
        for (int i = lane; i < SHORT_SLOTS; i += 32) {
            const float mi = sm_m[i];
            sm_m[i] = mi != NEG_INF ? expf(mi - M) : 0.f;
        }
    }
    __syncthreads();
    float S = 0.f;
    for (int i = 0; i < SHORT_SLOTS; ++i) S += sm_m[i] * sm_s[i];
    for (int c = tid; c < HEAD_DIM; c += SHORT_WARPS * 32) {
        float O = 0.f;
        for (int i = 0; i < SHORT_SLOTS; ++i) O += sm_m[i] * sm_o[i][c];
        out[h * HEAD_DIM + c] = f2h(O / S);
    }
}

extern "C" __global__ void __launch_bounds__(SHORT_WARPS * 32)
paged_decode_short(const unsigned short* __restrict__ q, const long long* __restrict__ page_ptrs, int page_tokens,
                   const int* __restrict__ step, int num_kv_heads, float scale, unsigned short* __restrict__ out,
                   const float* __restrict__ sinks)
{
    decode_short_body(q, page_ptrs, page_tokens, step, num_kv_heads, scale, out, nullptr, nullptr, sinks);
}

extern "C" __global__ void __launch_bounds__(SHORT_WARPS * 32)
paged_decode_short_append(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_new,
                          const unsigned short* __restrict__ v_new, const long long* __restrict__ page_ptrs,
                          int page_tokens, const int* __restrict__ step, int num_kv_heads, float scale,
                          unsigned short* __restrict__ out, const float* __restrict__ sinks)
{
    append_step_row(k_new, v_new, page_ptrs, page_tokens, step, num_kv_heads, SHORT_WARPS * 32);
    decode_short_body(q, page_ptrs, page_tokens, step, num_kv_heads, scale, out, k_new, v_new, sinks);
}

extern "C" __global__ void __launch_bounds__(SHORT_WARPS * 32)
paged_decode_short_append_batch(const unsigned short* __restrict__ q,       // [B, h_a, HEAD_DIM] fp16
                                const unsigned short* __restrict__ k_new,   // [B, h_kv, HEAD_DIM] fp16
                                const unsigned short* __restrict__ v_new,   // [B, h_kv, HEAD_DIM] fp16
                                const long long* __restrict__ seqs,         // [B, SEQ_FIELDS]
                                int page_tokens, int num_kv_heads, float scale,
                                unsigned short* __restrict__ out,           // [B, h_a, HEAD_DIM] fp16
                                const float* __restrict__ sinks)            // [h_a] fp32 (the layer's), or nullptr
{
    const long long* seq = seqs + (long long)blockIdx.z * SEQ_FIELDS;
    if (seq[SEQ_N_SPLITS] != 0) return;                 // a split-kernel sequence
    const long long b = blockIdx.z, q_row = b * num_kv_heads * GROUP * HEAD_DIM, kv_row = b * num_kv_heads * HEAD_DIM;
    const long long* ptrs = reinterpret_cast<const long long*>(seq[SEQ_PAGE_PTRS]);
    const int* st = reinterpret_cast<const int*>(seq[SEQ_STEP]);
    append_step_row(k_new + kv_row, v_new + kv_row, ptrs, page_tokens, st, num_kv_heads, SHORT_WARPS * 32);
    decode_short_body(q + q_row, ptrs, page_tokens, st, num_kv_heads, scale, out + q_row, k_new + kv_row,
                      v_new + kv_row, sinks);
}
#endif
"""
