"""A batched decode step's rows of a GPU stage's mixture-of-experts block in as few calls as one row takes: every
row's VRAM experts in the GPU's two expert launches (their m-row form), every row's host experts in one call of
the CPU library's m-row expert sum, x' = h + both shares in one launch.

Each row's bits are those runtime/moe_decode_row.MoeDecodeRow gives that row alone (what a served sequence's
single run computes), so a batched step is bit-identical per sequence:
- routing: route() on the host over the step's logits (each row's softmax and top-k its own), or, for a block with
  every expert in VRAM, MoeDecodeRow's routing kernel with one block a row;
- the GPU share: per row, its experts in VRAM in its top-k order, padded to k with slot 0 at weight 0, as the one
  row pads them; each (row, expert) pair through the one-row kernels' body on that row (schedules/gpu/moe_experts.py);
- the CPU share: each row's host experts ascending in the m-row expert sum (schedules/cpu/quant/moe_experts_rows.py),
  each row bit-identical to the one-row sum;
- the sum: MoeDecodeRow's combine, per row: h + sum_j w_j part_j, then + the CPU's sum, in fp32, one rounding.
The step runs eagerly: the GPU's share is queued before the CPU starts on its own, so the two run at once.
What crosses goes through pinned buffers made once per step size (BatchBuffers): m and the logits in one copy down
and one wait, the slots and weights (and the CPU's sum) in a copy up each, never waited on; the kernels' operands
and TVM views are made once too. Why, measured (H200 host, Qwen3-30B-A3B served 8 at once, cProfile of a step): a
block's Python around the kernels took ~1.1 ms of its ~2.4 ms with its CPU share, in pageable copies (each one waits
for the device), CuPy allocations and DLPack views made every block.
"""
from __future__ import annotations

import numpy as np

from helmc.runtime.crossing_buffers import CrossingBuffers
from helmc.runtime.moe_decode_row import BlockRow, MoeDecodeRow, route_rows
from helmc.runtime.moe_experts import expert_rows_args, route

_COMBINE_ROWS_SOURCE = """
int r = i / H;
int c = i - r * H;
float g = 0.f;
for (int j = 0; j < n_gpu; ++j) if (w[r * K + j] != 0.f) g += w[r * K + j] * (float)part[(r * K + j) * H + c];
float acc = (float)h[i] + g;
if (use_cpu) acc += y_cpu[i];
out = (float16)acc;
"""
_combine_rows = None


def combine_rows_kernel():
    """out [S, H] fp16 = h + sum_{j < n_gpu} w[r, j] * part[r, j] (+ y_cpu) per row r: MoeDecodeRow's combine."""
    global _combine_rows
    if _combine_rows is None:
        import cupy as cp
        _combine_rows = cp.ElementwiseKernel(
            "raw float16 h, raw float16 part, raw float32 w, raw float32 y_cpu, int32 n_gpu, int32 H, int32 K, "
            "int32 use_cpu", "float16 out", _COMBINE_ROWS_SOURCE, "helmc_moe_combine_rows")
    return _combine_rows


class BatchBuffers:
    """A batched step's buffers for S rows, made once: what crosses (pinned on the host, one device buffer each way),
    the GPU kernels' operands and their TVM views. Reuse is safe: every block's forward waits for the stream before
    it writes a pinned buffer (the copies of the block before have then completed), and x' alternates between two
    outputs (a block reads the last one), as MoeDecodeRow's do."""

    def __init__(self, S: int, H: int, E: int, K: int, I: int, from_cupy):
        import cupy as cp
        # device to host: m fp16 [S, H] | logits fp32 [S, E], one copy; host to device: slots int32 and weights fp32
        # [S, K] in one copy, the CPU's sum fp32 [S, H] (its m-row sum writes there) in another
        self._down = CrossingBuffers((("m", "float16", (S, H)), ("logits", "float32", (S, E))))
        self._up = CrossingBuffers((("sel", "int32", (S, K)), ("w", "float32", (S, K)), ("y", "float32", (S, H))))
        self.m, self.logits = self._down.device["m"], self._down.device["logits"]
        self.host_m, self.host_logits = self._down.host["m"], self._down.host["logits"]
        self.sel, self.w = (self._up.device[n].reshape(-1) for n in ("sel", "w"))          # [S * K] each
        self.y = self._up.device["y"]
        self.host_sel, self.host_w, self.host_y = (self._up.host[n] for n in ("sel", "w", "y"))
        self._x32 = np.zeros(S * H + 16, np.float32)
        skip = (-self._x32.ctypes.data % 64) // 4
        self.x32 = self._x32[skip:skip + S * H].reshape(S, H)     # m for the CPU in its dtype, 64-byte aligned (no copy)
        self.rows = cp.repeat(cp.arange(S, dtype=cp.int32), K)                 # [S * K]: pair j is row j // K
        self.a = cp.zeros((S * K, I), cp.float16)                              # [S * K, I] each pair's SwiGLU
        self.part = cp.zeros((S * K, H), cp.float16)                           # [S * K, H] each pair's down
        self.out = [cp.zeros((S, H), cp.float16) for _ in range(2)]
        self._next = 0
        self.views = {name: from_cupy(getattr(self, name)) for name in ("sel", "rows", "a", "part")}
        self.out_views = [from_cupy(o) for o in self.out]

    def down(self, m, logits) -> None:
        """m [S, H] fp16 and logits [S, E] fp32 (device) into pinned memory; returns once they are there."""
        import cupy as cp
        self.m[...] = m
        self.logits[...] = logits
        self._down.to_host("m", "logits")
        cp.cuda.get_current_stream().synchronize()

    def up_routes(self) -> None:
        """host_sel / host_w to the device, queued on the stream."""
        self._up.to_device("sel", "w")

    def up_cpu_sum(self) -> None:
        """host_y to the device, queued on the stream."""
        self._up.to_device("y")

    def next_out(self) -> tuple:
        i = self._next
        self._next = 1 - i
        return self.out[i], self.out_views[i]


class MoeDecodeBatch:
    """Called by moe_gpu.GpuMoeFeedForward for a batched decode step of a block MoeDecodeRow runs one row of."""

    def __init__(self, decode_row: MoeDecodeRow, cpu_rows: dict, gpu_rows: dict, to_cupy, from_cupy):
        self.decode_row = decode_row       # the one-row path: each block's BlockRow, the sizes, the routing
        self.cpu_rows = cpu_rows           # {expert signature: the CPU library's m-row expert sum}
        self.gpu_rows = gpu_rows           # {expert signature: moe_gpu.DeviceExpertSum of the m-row kernels}
        self.to_cupy, self.from_cupy = to_cupy, from_cupy
        self.steps = 0                     # blocks' batched steps run here (for the tests and the benchmarks)
        self.expert_rows = self.gpu_expert_rows = 0
        self._buffers: dict[int, BatchBuffers] = {}

    def applies(self, block: BlockRow) -> bool:
        sig = block.experts.signature
        if block.all_vram:
            return sig in self.gpu_rows
        return sig in self.cpu_rows and (not block.has_vram or sig in self.gpu_rows)

    def buffers(self, S: int) -> BatchBuffers:
        if S not in self._buffers:
            row = self.decode_row
            self._buffers[S] = BatchBuffers(S, row.H, row.E, row.K, row.a.shape[1], self.from_cupy)
        return self._buffers[S]

    def forward(self, h, m, logits, block: BlockRow):
        """x' [S, H] (a TVM tensor, fp16) of the block's post_moe outputs h, m [S, H] and logits [S, E]."""
        row = self.decode_row
        hc, mc, lc = self.to_cupy(h), self.to_cupy(m), self.to_cupy(logits)
        S, K = mc.shape[0], row.K
        b = self.buffers(S)
        self.steps += 1
        self.expert_rows += S * K
        if block.all_vram:
            sel, w = (a.reshape(-1) for a in route_rows(lc, row.moe))    # [S * K] each, one block a row
            self._gpu_pairs(block, b, m, self.from_cupy(sel))
            self.gpu_expert_rows += S * K
            return self._combine(b, hc, w, K, False)
        if block.cache is not None:         # the same residency the one-row path and prefill read
            block.cache.step()
        b.down(mc, lc)
        idx, wts = route(b.host_logits, row.moe)                        # [S, K] each, largest first
        if block.cache is not None:
            block.cache.residency.observe(idx)
        slots = block.slot_of[idx]                                      # [S, K]
        hit = slots >= 0
        n_gpu = 0
        if block.has_vram:                  # queued before the CPU starts: the devices work at once
            # each row's hits first, in its top-k order (a stable sort on "missed"); padding slot 0, weight 0
            order = np.argsort(~hit, axis=1, kind="stable")                                 # [S, K]
            b.host_sel[...] = np.take_along_axis(np.where(hit, slots, 0), order, axis=1)
            b.host_w[...] = np.take_along_axis(np.where(hit, wts, 0.0), order, axis=1)
            self.gpu_expert_rows += int(hit.sum())
            n_gpu = K
            b.up_routes()
            self._gpu_pairs(block, b, m, b.views["sel"])
        use_cpu = not hit.all()
        if use_cpu:
            self._cpu_rows(block, b, idx, wts, ~hit)
            b.up_cpu_sum()
        return self._combine(b, hc, b.w, n_gpu, use_cpu)

    def _gpu_pairs(self, block: BlockRow, b: BatchBuffers, x, sel) -> None:
        """b.part [S * K, H]: pair j = (row j // K, the expert at slot sel[j]) through the m-row kernels."""
        self.gpu_rows[block.experts.signature].run(x, sel, block.experts, b.views["a"], b.views["part"],
                                                   rows=b.views["rows"])

    def _cpu_rows(self, block: BlockRow, b: BatchBuffers, idx, wts, keep) -> None:
        """b.host_y [S, H] fp32: each row's host experts through the CPU library's m-row expert sum."""
        import tvm.runtime

        from helmc.runtime.tvm_tensors import cpu_tensor_view
        dev = tvm.cpu()
        np.copyto(b.x32, b.host_m, casting="same_kind")
        args = (b.x32,) + expert_rows_args(idx, wts, keep)
        self.cpu_rows[block.experts.signature](*(cpu_tensor_view(a, dev) for a in args), *block.experts.stacked,
                                               cpu_tensor_view(b.host_y, dev))

    def _combine(self, b: BatchBuffers, h, w, n_gpu: int, use_cpu: bool):
        S, H = h.shape
        out, view = b.next_out()
        combine_rows_kernel()(h, b.part, w, b.y, np.int32(n_gpu), np.int32(H), np.int32(self.decode_row.K),
                              np.int32(use_cpu), out)
        return view
