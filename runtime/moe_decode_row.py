"""One decode row of a GPU stage's mixture-of-experts block, on static buffers, in three parts around the host:

    begin(h, m, logits)   GPU: h, m, the router's logits into static buffers; m and logits to pinned host memory
                          (one copy). A block whose experts are all in VRAM is routed and finished here, on the GPU.
    host_half(block)      host, once that copy is done: the router's top-k (runtime/moe_experts.route); the selected
                          experts in VRAM queued on the GPU (their slots and weights cross in one copy, then the GPU
                          library's two expert kernels); the others summed by the CPU library's one-call expert sum,
                          straight into pinned memory, while the GPU runs its share.
    finish(block)         GPU: the CPU's sum crosses (one copy) and x' = h + sum_j w_j gpu_part_j + cpu_sum (fp32,
                          in that order) is written to a static fp16 buffer.
Why static buffers: every array and TVM view the GPU parts touch exists before the first step, so they run the same
eagerly and as captured CUDA graphs (runtime/moe_decode_graph.py: the host half between two graphs). A TVM view of a
CuPy array made during a capture would make the legacy stream wait on the capturing one, which ends the capture.
Invariant: begin() and finish() alternate, one block at a time; a block pending between them owns every buffer
(a replayed graph runs them without this Python: MoeDecodeGraph keeps the order).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from helmc.runtime.crossing_buffers import CrossingBuffers
from helmc.runtime.moe_experts import LayerExperts, OneRowExpertArgs, route

_COMBINE_SOURCE = """
float g = 0.f;
for (int j = 0; j < n_gpu; ++j) if (w[j] != 0.f) g += w[j] * (float)part[j * H + i];   // padding: not read
float acc = (float)h[i] + g;
if (use_cpu) acc += y_cpu[i];
out = (float16)acc;
"""
_combine_kernel = None

_ROUTE_SOURCE = r"""
extern "C" __global__ void helmc_moe_route(const float* logits, int E, int K, int norm, int topk_first, int* sel,
                                           float* w) {
  // one block of >= E threads. softmax_topk: softmax, each expert's rank (how many beat it: higher, or equal at a
  // lower index), the top K scattered by rank, renormalised. topk_first (gpt-oss): the ranks of the logits
  // themselves, then a softmax over the K picked. Every sum in index order, so the bits do not depend on scheduling.
  // one row per block: blockIdx.x's logits [E] -> its sel [K] and w [K] (a batched step launches one block a row)
  __shared__ float p[1024];
  __shared__ float top[64];
  logits += blockIdx.x * E;
  sel += blockIdx.x * K;
  w += blockIdx.x * K;
  int e = threadIdx.x;
  if (e < E) p[e] = logits[e];
  __syncthreads();
  float pe = e < E ? p[e] : 0.f;
  if (!topk_first) {
    float mx = p[0];
    for (int j = 1; j < E; ++j) mx = fmaxf(mx, p[j]);
    __syncthreads();
    if (e < E) p[e] = expf(p[e] - mx);
    __syncthreads();
    float sum = 0.f;
    for (int j = 0; j < E; ++j) sum += p[j];
    pe = e < E ? p[e] / sum : 0.f;
    __syncthreads();
    if (e < E) p[e] = pe;
    __syncthreads();
  }
  if (e < E) {
    // NaN ranks below every number (-inf included), NaNs by index: NumPy's stable sort of -p (route()), so a row
    // of NaN (a logit overflowed) picks experts 0..K-1 on both; without it no NaN is ranked and a row's K picks
    // were all expert 0
    bool nan_e = pe != pe;
    int rank = 0;
    for (int j = 0; j < E; ++j) {
      float pj = p[j];
      bool nan_j = pj != pj;
      rank += nan_j ? (nan_e && j < e) : (nan_e || pj > pe || (pj == pe && j < e));
    }
    if (rank < K) { sel[rank] = e; top[rank] = pe; }
  }
  __syncthreads();
  if (e < K) {
    if (topk_first) {      // route(): exp(z - z_0) over the K largest logits (largest first), over their sum
      float s = 0.f;
      for (int j = 0; j < K; ++j) s += expf(top[j] - top[0]);
      w[e] = expf(top[e] - top[0]) / s;
    } else {
      float s = 0.f;
      for (int j = 0; j < K; ++j) s += top[j];
      w[e] = norm ? top[e] / s : top[e];
    }
  }
}
"""
_route_kernel = None


def route_kernel():
    global _route_kernel
    if _route_kernel is None:
        import cupy as cp
        _route_kernel = cp.RawKernel(_ROUTE_SOURCE, "helmc_moe_route")
    return _route_kernel


def gpu_routes(moe) -> bool:
    """Whether helmc_moe_route computes this router's route(): its routing, and one block of threads holds a row."""
    return moe.routing in ("softmax_topk", "topk_softmax") and moe.num_experts <= 1024 and moe.top_k <= 64


def route_rows(logits, moe):
    """route() of device logits [S, E] fp32 on the device, one block a row: (sel [S, k] int32, w [S, k] fp32),
    largest first, ties to the lower index; nothing crosses to the host. gpu_routes(moe) must hold."""
    import cupy as cp
    both = cp.zeros((2,) + (logits.shape[0], moe.top_k), cp.int32)    # [2, S, k]: the picks, the weights' bits
    sel, w = both[0], both[1].view(cp.float32)
    _launch_route(logits, moe, sel, w)
    return sel, w


def route_rows_to_host(logits, moe) -> tuple[np.ndarray, np.ndarray]:
    """route() of device logits [S, E] as the host's route() gives it (idx int64, w fp32 [S, k]), routed on the device
    and brought back in one copy of 8 S k bytes instead of the logits' 4 S E. gpu_routes(moe) must hold."""
    import cupy as cp
    both = cp.zeros((2,) + (logits.shape[0], moe.top_k), cp.int32)
    _launch_route(logits, moe, both[0], both[1].view(cp.float32))
    host = both.get()
    return host[0].astype(np.int64), host[1].view(np.float32)


def _launch_route(logits, moe, sel, w) -> None:
    import cupy as cp
    S, E = logits.shape
    if S:
        route_kernel()((S,), (max(32, -(-E // 32) * 32),),
                       (cp.ascontiguousarray(logits, cp.float32), np.int32(E), np.int32(moe.top_k),
                        np.int32(bool(moe.norm_topk_prob)), np.int32(moe.routing == "topk_softmax"), sel, w))


def combine_kernel():
    """out [1, H] fp16 = h + sum_{j < n_gpu} w[j] * part[j] (+ y_cpu): one launch, fp32, a fixed order."""
    global _combine_kernel
    if _combine_kernel is None:
        import cupy as cp
        _combine_kernel = cp.ElementwiseKernel(
            "raw float16 h, raw float16 part, raw float32 w, raw float32 y_cpu, int32 n_gpu, int32 H, int32 use_cpu",
            "float16 out", _COMBINE_SOURCE, "helmc_moe_combine")
    return _combine_kernel


@dataclass(frozen=True)
class BlockRow:
    """What the decode row needs of one MoE block: its experts, which are in VRAM (slot_of[e] >= 0) and the
    compiled sums that run them."""
    experts: LayerExperts
    slot_of: np.ndarray          # [E] int32: expert e's slot in the stacked VRAM experts, -1 on the host
    cpu_sum: object              # the CPU library's one-call expert sum for the block's type signature, or None
    gpu_sum: object              # moe_gpu.DeviceExpertSum (its two kernels), or None
    all_vram: bool               # every expert in VRAM and the GPU's kernels run them: routed on the GPU
    cache: object = None         # moe_expert_cache.VramExpertCache moving experts into the slots, or None (slot_of
                                 # is then its residency's, changed in place)

    @property
    def has_vram(self) -> bool:
        return self.experts.vram_stacked is not None and bool(self.experts.on_gpu)


class MoeDecodeRow:
    def __init__(self, spec, cpu_sums: dict, gpu_sums: dict, to_cupy, from_cupy):
        import cupy as cp
        H, E, K, I = spec.hidden_size, spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_intermediate_size
        self.H, self.E, self.K, self.moe = H, E, K, spec.moe
        self.cpu_sums, self.gpu_sums, self.to_cupy = cpu_sums, gpu_sums, to_cupy
        # device to host: m fp16 [1, H] | logits fp32 [1, E], one copy; host to device: the GPU share's slots and
        # weights [K] in one copy, the CPU's sum [1, H] in another
        self._down = CrossingBuffers((("m", "float16", (1, H)), ("logits", "float32", (1, E))))
        self._up = CrossingBuffers((("sel", "int32", (K,)), ("w", "float32", (K,)), ("y", "float32", (1, H))))
        self.m, self.logits = self._down.device["m"], self._down.device["logits"]
        self.host_m, self.host_logits = self._down.host["m"], self._down.host["logits"]
        self.sel, self.w, self.y = (self._up.device[n] for n in ("sel", "w", "y"))
        self.host_sel, self.host_w, self.host_y = (self._up.host[n] for n in ("sel", "w", "y"))
        self.h = cp.zeros((1, H), cp.float16)
        self.a = cp.zeros((K, I), cp.float16)                       # [K, I] each GPU expert's SwiGLU
        self.part = cp.zeros((K, H), cp.float16)                    # [K, H] each one's down
        self.out = [cp.zeros((1, H), cp.float16) for _ in range(2)]  # x' alternates: a block reads the last one
        self._next_out = 0
        # the CPU's inputs, and TVM views of everything, made once (see the module's note); its sum lands in pinned
        # memory, where finish() copies it from
        self.cpu_args = OneRowExpertArgs(H, K, y=self.host_y)
        self._m_view, self._sel_view, self._a_view, self._part_view = (from_cupy(t) for t in
                                                                       (self.m, self.sel, self.a, self.part))
        self._out_views = [from_cupy(o) for o in self.out]
        self._rows: dict[int, BlockRow] = {}
        self.pending: BlockRow | None = None
        self._copy_stream = None                        # the VRAM expert cache's copies (moe_expert_cache.py)
        self.expert_rows = self.gpu_expert_rows = 0     # selected (row, expert) pairs, those served from VRAM
        # the host halves run and their wall time, the CPU's expert sum left out (the cost model prices that on its
        # own): what the GPU waits for at each such block beside the copy's wait (helmc calibrate measures it here)
        self.host_halves, self.host_half_s = 0, 0.0

    # ------------------------------------------------------------------ what a block needs
    def block(self, experts: LayerExperts) -> BlockRow | None:
        """The block's row state, or None when this path cannot run it (float experts, a type without the one-call
        sums): the per-expert path does."""
        key = id(experts)
        if key not in self._rows:
            self._rows[key] = self._block(experts)
        return self._rows[key]

    def _block(self, experts: LayerExperts) -> BlockRow | None:
        slot_of = np.full(self.E, -1, np.int32)
        for s, e in enumerate(experts.vram_order):
            slot_of[e] = s
        cache = None
        if experts.residency is not None and experts.vram_stacked is not None:
            from helmc.runtime.moe_expert_cache import VramExpertCache
            if self._copy_stream is None:
                import cupy as cp
                self._copy_stream = cp.cuda.Stream(non_blocking=True)
            cache = VramExpertCache(experts.residency, experts.stacked, experts.vram_stacked, self._copy_stream)
            slot_of = experts.residency.slot_of
        cpu_sum = self.cpu_sums.get(experts.signature) if experts.stacked is not None else None
        gpu_sum = self.gpu_sums.get(experts.signature) if experts.vram_stacked is not None else None
        all_vram = (gpu_sum is not None and tuple(experts.vram_order) == tuple(range(self.E))   # slot = expert
                    and gpu_routes(self.moe))                            # the routing kernel's
        if not all_vram and (cpu_sum is None or (experts.on_gpu and gpu_sum is None)):
            return None
        return BlockRow(experts, slot_of, cpu_sum, gpu_sum, all_vram, cache if not all_vram else None)

    # ------------------------------------------------------------------ the three parts
    def begin(self, h, m, logits, row: BlockRow):
        """GPU: the block's post_moe outputs into the static buffers. Returns x' (a TVM tensor) for a block routed
        on the GPU, else None: m and the logits are on their way to pinned memory; call host_half() once the stream
        has reached here, then finish()."""
        assert self.pending is None, "MoeDecodeRow.begin: the last block was never finished"
        if row.all_vram:              # nothing crosses: the kernels read post_moe's own outputs
            self._route_on_gpu(self.to_cupy(logits))
            self._gpu_experts(row, m)
            self.expert_rows += self.K
            self.gpu_expert_rows += self.K
            return self._combine_into_out(self.to_cupy(h), self.K, use_cpu=False)
        self.h[...] = self.to_cupy(h)
        self.m[...] = self.to_cupy(m)
        self.logits[...] = self.to_cupy(logits)
        self.pending = row
        self._down.to_host("m", "logits")
        return None

    def host_half(self, row: BlockRow, launch_gpu_experts=None) -> None:
        """Host: route the block's row, queue its VRAM experts (launch_gpu_experts(row), or eagerly), run the CPU's
        share into pinned memory. The stream must have completed the block's begin() (run or replayed)."""
        assert not row.all_vram, "MoeDecodeRow.host_half: this block is routed on the GPU"
        start = time.perf_counter()
        self.host_halves += 1
        if row.cache is not None:        # copies done serve from now on; promotions due start (never waited on)
            row.cache.step()
        idx, w = route(self.host_logits, self.moe)                     # [1, K] each, largest first
        if row.cache is not None:
            row.cache.residency.observe(idx)
        idx, w = idx[0], w[0]
        slots = row.slot_of[idx]                                        # [K]
        hit = slots >= 0
        self.expert_rows += self.K
        if row.has_vram:
            n = int(hit.sum())
            self.gpu_expert_rows += n
            self.host_sel[:] = 0              # padding: slot 0 (there is one: the block has VRAM experts), weight 0
            self.host_w[:] = 0.0
            self.host_sel[:n] = slots[hit]
            self.host_w[:n] = w[hit]
            (launch_gpu_experts or self.gpu_experts)(row)
        cpu = np.nonzero(~hit)[0]
        if cpu.size == 0:
            self.host_y[...] = 0.0
            self.host_half_s += time.perf_counter() - start
            return
        cpu = cpu[np.argsort(idx[cpu], kind="stable")]                # ascending expert ids: a fixed sum order
        n = cpu.size
        args = self.cpu_args
        args.sel[:n] = idx[cpu]
        args.w[:n] = w[cpu]
        np.copyto(args.x, self.host_m, casting="same_kind")
        self.host_half_s += time.perf_counter() - start
        args.run(row.cpu_sum, row.experts.stacked, n)

    def gpu_experts(self, row: BlockRow) -> None:
        """GPU: the slots and weights host_half() wrote cross, then the block's VRAM experts run on them."""
        self._up.to_device("sel", "w")
        self._gpu_experts(row)

    def finish(self, use_cpu: bool = True):
        """GPU: x' = h + the GPU share + the CPU's sum into the next static output; returns its TVM view."""
        row = self.pending
        assert row is not None, "MoeDecodeRow.finish: no block pending"
        if use_cpu:
            self._up.to_device("y")
        out = self._combine_into_out(self.h, self.K if row.has_vram else 0, use_cpu)
        self.pending = None
        return out

    def _combine_into_out(self, h, n_gpu: int, use_cpu: bool):
        i = self._next_out
        self._next_out = 1 - i
        combine_kernel()(h, self.part, self.w, self.y, np.int32(n_gpu), np.int32(self.H), np.int32(use_cpu),
                         self.out[i])
        return self._out_views[i]

    # ------------------------------------------------------------------ GPU pieces
    def _gpu_experts(self, row: BlockRow, m=None) -> None:
        row.gpu_sum.run(self._m_view if m is None else m, self._sel_view, row.experts, self._a_view, self._part_view)

    def _route_on_gpu(self, logits) -> None:
        """route() on the device for a block with every expert in VRAM at its own slot: one launch (_ROUTE_SOURCE),
        no sort, no host sync."""
        _launch_route(logits, self.moe, self.sel, self.w)                # logits [1, E]: one block
