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
"""
from __future__ import annotations

import numpy as np

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


class MoeDecodeBatch:
    """Called by moe_gpu.GpuMoeFeedForward for a batched decode step of a block MoeDecodeRow runs one row of."""

    def __init__(self, decode_row: MoeDecodeRow, cpu_rows: dict, gpu_rows: dict, to_cupy, from_cupy):
        self.decode_row = decode_row       # the one-row path: each block's BlockRow, the sizes, the routing
        self.cpu_rows = cpu_rows           # {expert signature: the CPU library's m-row expert sum}
        self.gpu_rows = gpu_rows           # {expert signature: moe_gpu.DeviceExpertSum of the m-row kernels}
        self.to_cupy, self.from_cupy = to_cupy, from_cupy
        self.steps = 0                     # blocks' batched steps run here (for the tests and the benchmarks)
        self.expert_rows = self.gpu_expert_rows = 0

    def applies(self, block: BlockRow) -> bool:
        sig = block.experts.signature
        if block.all_vram:
            return sig in self.gpu_rows
        return sig in self.cpu_rows and (not block.has_vram or sig in self.gpu_rows)

    def forward(self, h, m, logits, block: BlockRow):
        """x' [S, H] (a TVM tensor, fp16) of the block's post_moe outputs h, m [S, H] and logits [S, E]."""
        import cupy as cp
        row = self.decode_row
        hc, mc, lc = self.to_cupy(h), self.to_cupy(m), self.to_cupy(logits)
        S, K, H = mc.shape[0], row.K, row.H
        self.steps += 1
        self.expert_rows += S * K
        if block.all_vram:
            sel, w = (a.reshape(-1) for a in route_rows(lc, row.moe))    # [S * K] each, one block a row
            part = self._gpu_pairs(block, mc, sel)
            self.gpu_expert_rows += S * K
            return self._combine(hc, part, w, cp.zeros((S, H), cp.float32), K, False)
        if block.cache is not None:         # the same residency the one-row path and prefill read
            block.cache.step()
        idx, wts = route(cp.asnumpy(lc), row.moe)                       # [S, K] each, largest first
        if block.cache is not None:
            block.cache.residency.observe(idx)
        slots = block.slot_of[idx]                                      # [S, K]
        hit = slots >= 0
        part, w, n_gpu = None, cp.zeros(S * K, cp.float32), 0
        if block.has_vram:                  # queued before the CPU starts: the devices work at once
            host_sel, host_w = np.zeros((S, K), np.int32), np.zeros((S, K), np.float32)
            for r in range(S):              # each row's hits first, in its top-k order; padding slot 0, weight 0
                n = int(hit[r].sum())
                host_sel[r, :n], host_w[r, :n] = slots[r][hit[r]], wts[r][hit[r]]
            self.gpu_expert_rows += int(hit.sum())
            w, n_gpu = cp.asarray(host_w.reshape(-1)), K
            part = self._gpu_pairs(block, mc, cp.asarray(host_sel.reshape(-1)))
        y = np.zeros((S, H), np.float32)
        if not hit.all():
            y = self._cpu_rows(block, cp.asnumpy(mc).astype(np.float32), idx, wts, ~hit)
        return self._combine(hc, part, w, cp.asarray(y), n_gpu, True)

    def _gpu_pairs(self, block: BlockRow, x, sel):
        """part [S * K, H] fp16: pair j = (row j // K, the expert at slot sel[j]) through the m-row kernels."""
        import cupy as cp
        S, K = x.shape[0], self.decode_row.K
        rows = cp.repeat(cp.arange(S, dtype=cp.int32), K)
        a = cp.empty((S * K, self.decode_row.a.shape[1]), cp.float16)     # [S * K, I] each pair's SwiGLU
        part = cp.empty((S * K, x.shape[1]), cp.float16)
        kernels = self.gpu_rows[block.experts.signature]
        gate, up, down = block.experts.vram_stacked
        f = self.from_cupy
        kernels.gate_up(f(x), f(sel), f(rows), gate, up, f(a))
        kernels.down(f(a), f(sel), down, f(part))
        return part

    def _cpu_rows(self, block: BlockRow, x: np.ndarray, idx, wts, keep) -> np.ndarray:
        import tvm.runtime

        from helmc.runtime.tvm_tensors import cpu_tensor_view, host_view
        dev = tvm.cpu()
        y = tvm.runtime.empty(x.shape, "float32", dev)
        args = (x,) + expert_rows_args(idx, wts, keep)
        self.cpu_rows[block.experts.signature](*(cpu_tensor_view(a, dev) for a in args), *block.experts.stacked, y)
        return host_view(y)

    def _combine(self, h, part, w, y, n_gpu: int, use_cpu: bool):
        import cupy as cp
        S, H = h.shape
        part = cp.zeros((1, H), cp.float16) if part is None else part
        out = cp.empty((S, H), cp.float16)
        combine_rows_kernel()(h, part, w, y, np.int32(n_gpu), np.int32(H), np.int32(self.decode_row.K),
                              np.int32(use_cpu), out)
        return self.from_cupy(out)
