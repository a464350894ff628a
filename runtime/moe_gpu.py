"""A mixture-of-experts block on the GPU stage: attention, the norms and the router on the GPU, the routed experts
on the CPU from host RAM (KTransformers' split: the few bytes a token needs from each expert are read where they
lie, never copied over PCIe).

Per block and step (the GPU stage calls it where a dense block calls post_attn):
    h, m, logits = post_moe(x, attn, w_o, ln2, w_router)            on the GPU (the GPU library's post_moe)
    m, logits  -> host                                               [S, H] fp16 and [S, E] fp32, one copy each
    y = MoeFeedForward.routed_sum(phase, m, logits, experts)         on the CPU (the CPU library's expert functions)
    x' = h + y                                                       y crosses back; the add on the GPU, in fp32
A block's experts listed in Plan.gpu_experts are in VRAM instead: the GPU computes them (the GPU library's expert
functions), queued before the CPU starts on the others, so the two devices work at once; their sums add on the GPU.
The expert weights are bound once on the host (runtime/weights/bind.py, `experts_on`), mmapped pages released.
The step waits on the host between blocks, so a stage with MoE blocks decodes without a CUDA graph. When every
expert is in VRAM and the GPU's expert kernels run them, a decode row is routed on the GPU and nothing waits on
the host, but capturing that step is still invalidated: no graph yet.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from helmc.runtime.moe_experts import LayerExperts, MoeFeedForward, find_expert_sums, route
from helmc.runtime.function_names import block_function_name, gpu_moe_names


class GpuMoeFeedForward:
    """Called as MoeFeedForward is: `ffn(phase, signature)(x, attn, w_o, ln2, w_router, LayerExperts)` -> x' (a
    device tensor [S, H], the stage's activation dtype)."""

    def __init__(self, gpu_vm, host: MoeFeedForward, device: MoeFeedForward, phases: tuple[str, ...], signatures,
                 to_cupy: Callable, from_cupy: Callable, device_sums: dict | None = None):
        self.host = host                        # the CPU library's expert functions over host rows
        self.device = device                    # the GPU library's, for the experts in VRAM
        self.device_sums = device_sums or {}    # {expert signature: DeviceExpertSum}, one decode row's VRAM experts
        self.to_cupy, self.from_cupy = to_cupy, from_cupy
        self._post = {(p, j): gpu_vm[block_function_name("post_moe", p, j)] for p in phases for j in set(signatures)}
        self._calls = {(p, j): (lambda *a, _p=p, _j=j: self.forward(_p, *a, signature=_j))
                       for p in phases for j in set(signatures)}
        # for the benchmarks: blocks whose rows went to the host and back; (row, expert) pairs, those in VRAM
        self.crossings = self.expert_rows = self.gpu_expert_rows = 0

    def hit_rate(self) -> float:
        """The share of selected (row, expert) pairs whose expert was in VRAM, over the session so far."""
        return self.gpu_expert_rows / self.expert_rows if self.expert_rows else 0.0

    def __call__(self, phase: str, signature: int = 0) -> Callable:
        return self._calls[(phase, signature)]

    def forward(self, phase: str, x, attn, w_o, ln2, w_router, experts: LayerExperts, signature: int = 0):
        import cupy as cp
        h, m, logits = self._post[(phase, signature)](x, attn, w_o, ln2, w_router)
        m_dev = self.to_cupy(m)
        # one decode row whose block has its VRAM experts stacked: the GPU's two expert kernels run them
        one_call = (self.device_sums.get(experts.signature)
                    if experts.vram_stacked is not None and phase != "prefill" and m_dev.shape[0] == 1 else None)
        if one_call is not None and len(experts.on_gpu) == len(experts.experts):
            self.expert_rows += one_call.top_k       # every expert in VRAM: routed on the GPU, no host round trip
            self.gpu_expert_rows += one_call.top_k
            y = self.to_cupy(h).astype(cp.float32) + one_call.device_routed(m_dev, self.to_cupy(logits), experts)
            return self.from_cupy(y.astype(m_dev.dtype))
        m_host = cp.asnumpy(m_dev).astype(np.float32)                    # [S, H]: the CPU stage's activation dtype
        idx, w = route(cp.asnumpy(self.to_cupy(logits)), self.host.moe)  # [S, E] -> [S, k] each, on the host
        hc = self.to_cupy(h).astype(cp.float32)                          # [S, H]
        if experts.on_gpu:       # queued on the stream before the CPU starts its share: the two run together
            if one_call is not None:
                hc += one_call.host_routed(m_dev, idx[0], w[0], experts)
            else:
                hc += self.device.expert_sum(phase, m_dev, idx, w, experts, only=experts.on_gpu)
            self.gpu_expert_rows += int(np.isin(idx, list(experts.on_gpu)).sum())
        y = self.host.expert_sum(phase, m_host, idx, w, experts, skip=experts.on_gpu)   # [S, H] float32 on the host
        self.expert_rows += idx.size
        self.crossings += 1
        return self.from_cupy((hc + cp.asarray(y)).astype(m_dev.dtype))


class DeviceExpertSum:
    """One decode row's experts in VRAM through the GPU library's two expert kernels (gate_up, down: schedules/gpu/
    moe_experts.py) over the block's stacked VRAM experts, then their weighted sum in fp32 on the GPU."""

    def __init__(self, gate_up, down, moe, inter: int, hidden: int, from_cupy: Callable):
        import cupy as cp
        self.gate_up, self.down, self.moe, self.top_k = gate_up, down, moe, moe.top_k
        self.from_cupy = from_cupy
        self._a = cp.empty((moe.top_k, inter), cp.float16)              # [k, I] each selected expert's SwiGLU
        self._part = cp.empty((moe.top_k, hidden), cp.float16)          # [k, H] each one's down

    def _run(self, m_dev, slots, weights, experts: LayerExperts):
        """sum_j weights[j] * expert at slot slots[j] (device arrays [n]) of m_dev [1, H] fp16 -> fp32 [1, H]."""
        n = int(slots.shape[0])
        gate, up, down = experts.vram_stacked
        sel = self.from_cupy(slots)
        self.gate_up(self.from_cupy(m_dev), sel, gate, up, self.from_cupy(self._a))
        self.down(self.from_cupy(self._a), sel, down, self.from_cupy(self._part))
        return (weights[:, None] * self._part[:n].astype(weights.dtype)).sum(axis=0, keepdims=True)   # [1, H]

    def host_routed(self, m_dev, idx: np.ndarray, w: np.ndarray, experts: LayerExperts):
        """The row's selected experts (idx, w [k] from route, on the host) that are in VRAM."""
        import cupy as cp
        slot_of = {e: s for s, e in enumerate(experts.vram_order)}
        keep = [j for j in range(idx.shape[0]) if int(idx[j]) in slot_of]
        if not keep:
            return cp.zeros((1, m_dev.shape[1]), cp.float32)
        return self._run(m_dev, cp.asarray(np.array([slot_of[int(idx[j])] for j in keep], np.int32)),
                         cp.asarray(w[keep].astype(np.float32)), experts)

    def device_routed(self, m_dev, logits, experts: LayerExperts):
        """Every expert in VRAM, slots in expert order: route() on the GPU (softmax, top-k, renormalised), no copy
        to the host."""
        import cupy as cp
        z = logits[0].astype(cp.float32)                                # [E]
        p = cp.exp(z - z.max())
        p /= p.sum()
        # top-k without a sort or a host sync (plain kernels a CUDA graph captures): each expert's rank is how many
        # beat it (higher, or equal at a lower index); scattering expert ids by rank orders them, largest first
        e = cp.arange(p.shape[0], dtype=cp.int32)                        # [E]
        beats = (p[None, :] > p[:, None]) | ((p[None, :] == p[:, None]) & (e[None, :] < e[:, None]))   # [E, E]
        order = cp.empty_like(e)
        order[beats.sum(axis=1)] = e                                      # order[rank] = expert
        top = order[:self.top_k]                                          # [k]
        w = p[top]
        if self.moe.norm_topk_prob:
            w = w / w.sum()
        assert experts.vram_order == tuple(range(logits.shape[1])), "every expert in VRAM, at its own slot"
        return self._run(m_dev, top, w, experts)


def device_expert_sums(gpu_vm, spec, from_cupy) -> dict:
    """{expert signature index: DeviceExpertSum} for the signatures the GPU library has kernels for."""
    out = {}
    for j, (gate, up, down) in enumerate(spec.expert_signatures()):
        if not (gate and gate == up and down) or spec.dtype != "float16":     # the kernels' activations are fp16
            continue
        names = gpu_moe_names(gate, down, spec.moe.num_experts, spec.moe.expert_intermediate_size, spec.hidden_size)
        try:
            kernels = [gpu_vm.module.get_function(n, query_imports=True) for n in names]
        except AttributeError:
            continue
        out[j] = DeviceExpertSum(*kernels, spec.moe, spec.moe.expert_intermediate_size, spec.hidden_size,
                                 from_cupy)
    return out


def gpu_moe_feed_forward(cpu_vm, gpu_vm, spec, layers: range, batch_sizes: tuple[int, ...], to_cupy, from_cupy):
    """The GPU stage's MoE blocks' feed-forward over `layers` (None when none of them is routed): the host half
    from the CPU library's expert functions, the device half from the GPU library's post_moe."""
    import tvm.runtime

    from helmc.runtime.stage import batch_phase
    from helmc.runtime.tvm_tensors import cpu_tensor_view, host_view
    if not any(spec.is_moe_layer(i) for i in layers):
        return None
    phases = ("prefill", "decode") + tuple(batch_phase(b) for b in batch_sizes)
    dev = tvm.cpu()
    import cupy as cp
    expert_sigs = [spec.expert_signature_index(i) for i in layers if spec.is_moe_layer(i)]
    host = MoeFeedForward(cpu_vm, spec.moe, phases, batch_sizes, host_view, lambda a: cpu_tensor_view(a, dev),
                          signatures=(), expert_signatures=expert_sigs, expert_sums=find_expert_sums(cpu_vm, spec))
    device = MoeFeedForward(gpu_vm, spec.moe, phases, batch_sizes, to_cupy, from_cupy, signatures=(),
                            expert_signatures=expert_sigs, xp=cp)
    return GpuMoeFeedForward(gpu_vm, host, device, phases, [spec.signature_index(i) for i in layers], to_cupy,
                             from_cupy, device_expert_sums(gpu_vm, spec, from_cupy))
