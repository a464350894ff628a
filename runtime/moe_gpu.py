"""A mixture-of-experts block on the GPU stage: attention, the norms and the router on the GPU, the routed experts
on the CPU from host RAM (KTransformers' split: the few bytes a token needs from each expert are read where they
lie, never copied over PCIe).

Per block and step (the GPU stage calls it where a dense block calls post_attn):
    h, m, logits = post_moe(x, attn, w_o, ln2, w_router)            on the GPU (the GPU library's post_moe; gpt-oss:
                                                                     o_proj's bias after w_o, the router's after
                                                                     w_router, so its logits carry the bias)
    m, logits  -> host                                               [S, H] fp16 and [S, E] fp32, one copy each
                                                                     (a prompt's rows routed on the GPU: their picks
                                                                     and weights cross, [S, k] each, not the logits)
    y = MoeFeedForward.routed_sum(phase, m, logits, experts)         on the CPU (the CPU library's expert functions)
    x' = h + y                                                       y crosses back; the add on the GPU, in fp32
A block's experts listed in Plan.placement.gpu_experts are in VRAM instead: the GPU computes them (the GPU library's expert
functions, or its two-launch expert kernels: plain and gpt-oss's biased ones), queued before the CPU starts on the
others, so the two devices work at once; their sums add on the GPU.
With Plan.placement.expert_cache the experts holding those VRAM slots change at run time (moe_expert_cache.py): every
path here asks the block's LayerExperts which are in VRAM now (in_vram(), weights(e)).
The expert weights are bound once on the host (runtime/weights/bind.py, `experts_on`), mmapped pages released.
One decode row of quantized fp16 experts goes through moe_decode_row.MoeDecodeRow (the one-call expert sums on both
sides, static buffers), which moe_decode_graph.MoeDecodeGraph replays as CUDA graphs between the host's halves; a
batched step of such a block through moe_decode_batch.MoeDecodeBatch (the same calls in their m-row forms, each row
the bits of its one-row step); prefill and other experts take the per-expert path here, eagerly.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from helmc.runtime.moe_decode_row import gpu_routes, route_rows_to_host
from helmc.runtime.moe_experts import LayerExperts, MoeFeedForward, find_expert_sums, route
from helmc.runtime.function_names import block_function_name, gpu_moe_names, gpu_moe_rows_names


class GpuMoeFeedForward:
    """Called as MoeFeedForward is: `ffn(phase, signature)(x, attn, w_o, [b_o,] ln2, w_router, [b_router,]
    LayerExperts)` -> x' (a device tensor [S, H], the stage's activation dtype)."""

    def __init__(self, gpu_vm, host: MoeFeedForward, device: MoeFeedForward, phases: tuple[str, ...], signatures,
                 to_cupy: Callable, from_cupy: Callable, decode_row=None, prefill=None, decode_batch=None):
        self.host = host                        # the CPU library's expert functions over host rows
        self.device = device                    # the GPU library's, for the experts in VRAM
        self.decode_row = decode_row            # MoeDecodeRow: one decode row on the one-call sums, or None
        self.decode_batch = decode_batch        # MoeDecodeBatch: a batched step's rows on the m-row sums, or None
        self.deferred = False                   # set by MoeDecodeGraph: a decode row's host half runs between graphs
        self.prefill = prefill                  # moe_prefill.ExpertPrefill: a prompt's experts all on the GPU, or None
        self.to_cupy, self.from_cupy = to_cupy, from_cupy
        self._post = {(p, j): gpu_vm[block_function_name("post_moe", p, j)] for p in phases for j in set(signatures)}
        self._calls = {(p, j): (lambda *a, _p=p, _j=j: self.forward(_p, *a, signature=_j))
                       for p in phases for j in set(signatures)}
        # for the benchmarks: blocks whose rows went to the host and back; (row, expert) pairs, those in VRAM
        self.crossings = self.expert_rows = self.gpu_expert_rows = 0
        self.prefill_rows = [0, 0]              # of those pairs, a prompt's (prefill's), and those in VRAM

    def hit_rate(self) -> float:
        """The share of selected (row, expert) pairs whose expert was in VRAM, over the session so far."""
        rows, hits = self.served()
        return hits / rows if rows else 0.0

    def served(self, decode: bool = False) -> tuple[int, int]:
        """(selected (row, expert) pairs, those served from VRAM) over the session so far; with `decode`, of the
        decode rows and batched steps alone (where the VRAM expert cache acts)."""
        parts = [p for p in (self, self.decode_row, self.decode_batch) if p is not None]
        rows, hits = sum(p.expert_rows for p in parts), sum(p.gpu_expert_rows for p in parts)
        return (rows - self.prefill_rows[0], hits - self.prefill_rows[1]) if decode else (rows, hits)

    def cache_promotions(self) -> int:
        """Experts the VRAM expert cache has copied into its slots, every block, over the session so far."""
        rows = self.decode_row._rows.values() if self.decode_row is not None else ()
        return sum(r.cache.residency.promotions for r in rows if r is not None and r.cache is not None)

    def __call__(self, phase: str, signature: int = 0) -> Callable:
        return self._calls[(phase, signature)]

    def row_of(self, experts: LayerExperts):
        """The decode row's state for this block, or None when the block's experts take the per-expert path."""
        return self.decode_row.block(experts) if self.decode_row is not None else None

    def forward(self, phase: str, x, attn, *weights, signature: int = 0):
        """weights: post_moe's (ModelSpec.post_attn_weight_names: o_proj's and the router's biases where the model
        has them), then the block's LayerExperts."""
        import cupy as cp
        *weights, experts = weights
        h, m, logits = self._post[(phase, signature)](x, attn, *weights)
        row = self.row_of(experts) if phase == "decode" and m.shape[0] == 1 else None
        if row is not None:
            out = self.decode_row.begin(h, m, logits, row)
            if out is not None or self.deferred:    # routed on the GPU; or the graph runs the host half
                return out
            self.crossings += 1
            cp.cuda.get_current_stream().synchronize()
            self.decode_row.host_half(row)
            return self.decode_row.finish()
        if phase.startswith("decode_b") and self.decode_batch is not None:
            row = self.row_of(experts)
            if row is not None and self.decode_batch.applies(row):
                self.crossings += not row.all_vram
                return self.decode_batch.forward(h, m, logits, row)
        m_dev = self.to_cupy(m)
        hc = self.to_cupy(h).astype(cp.float32)                          # [S, H]
        vram = experts.in_vram()        # now: the VRAM expert cache's residency where it runs
        if phase == "prefill" and self.prefill is not None and self.prefill.applies(experts):
            # every expert on the GPU, host ones streamed; routed and grouped on the GPU where the kernel can
            idx, g = self.prefill.add_routed(m_dev, self.to_cupy(logits), experts, hc)
            self._count(experts, idx, int(g.counts()[sorted(vram)].sum()) if vram else 0, prefill=True)
            return self.from_cupy(hc.astype(m_dev.dtype))
        if phase == "prefill" and gpu_routes(self.host.moe):          # [S, E] -> [S, k] each: a prompt's on the GPU
            idx, w = route_rows_to_host(self.to_cupy(logits), self.host.moe)
        else:
            idx, w = route(cp.asnumpy(self.to_cupy(logits)), self.host.moe)   # on the host
        self._count(experts, idx, int(np.isin(idx, list(vram)).sum()) if vram else 0, prefill=phase == "prefill")
        m_host = cp.asnumpy(m_dev).astype(np.float32)                    # [S, H]: the CPU stage's activation dtype
        if vram:                 # queued on the stream before the CPU starts its share: the two run together
            hc += self.device.expert_sum(phase, m_dev, idx, w, experts, only=vram)
        y = self.host.expert_sum(phase, m_host, idx, w, experts, skip=vram)   # [S, H] float32 on the host
        self.crossings += 1
        return self.from_cupy((hc + cp.asarray(y)).astype(m_dev.dtype))

    def _count(self, experts: LayerExperts, idx, hits: int, prefill: bool) -> None:
        """A block's selected pairs (idx [S, k], host or device) and those in VRAM into the counters; idx into the
        routing statistics while they are measured (the only reason a device idx crosses)."""
        self.expert_rows += idx.size
        self.gpu_expert_rows += hits
        if prefill:
            self.prefill_rows[0] += idx.size
            self.prefill_rows[1] += hits
        if self.host.routing is not None:
            self.host.routing.record(experts.layer, idx if isinstance(idx, np.ndarray) else idx.get())


class DeviceExpertSum:
    """The GPU library's two expert kernels for one expert type signature (gate_up, down: schedules/gpu/
    moe_experts.py, or moe_experts_biased.py's for gpt-oss, whose kernels take the block's LayerExperts.vram_biases
    after the weights), run over a block's stacked VRAM experts by moe_decode_row.MoeDecodeRow."""

    def __init__(self, gate_up, down):
        self.gate_up, self.down = gate_up, down

    def run(self, x, sel, experts: LayerExperts, a, part, rows=None) -> None:
        """a = each selected slot's (clamped) SwiGLU of x (or x's row rows[j], the m-row kernels), part = its down:
        the biases, where the experts have them, after each launch's weights."""
        gate, up, down = experts.vram_stacked
        b = experts.vram_biases                         # () or (b_gate, b_up, b_down)
        self.gate_up(x, sel, *((rows,) if rows is not None else ()), gate, up, *b[:2], a)
        self.down(a, sel, down, *b[2:], part)


def device_expert_sums(gpu_vm, spec, from_cupy, rows: bool = False) -> dict:
    """{expert signature index: DeviceExpertSum} for the signatures the GPU library has kernels for; with `rows`,
    the m-row kernels of batched steps (absent in older bundles). gpt-oss's biased, clamped experts take the biased
    kernels (`_biased` names); where a bundle lacks them their VRAM experts take the expert function per expert."""
    out = {}
    moe = spec.moe
    if not (moe.plain_experts or moe.biased_experts):
        return out
    for j, (gate, up, down) in enumerate(spec.expert_signatures()):
        if not (gate and gate == up and down) or spec.dtype != "float16":     # the kernels' activations are fp16
            continue
        names = (gpu_moe_rows_names if rows else gpu_moe_names)(gate, down, moe.num_experts,
                                                                moe.expert_intermediate_size, spec.hidden_size,
                                                                biased=moe.biased_experts)
        try:
            kernels = [gpu_vm.module.get_function(n, query_imports=True) for n in names]
        except AttributeError:
            continue
        out[j] = DeviceExpertSum(*kernels)
    return out


def gpu_moe_feed_forward(cpu_vm, gpu_vm, spec, layers: range, batch_sizes: tuple[int, ...], to_cupy, from_cupy,
                         expert_staging_bytes: int = 0):
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
                          signatures=(), expert_signatures=expert_sigs, expert_sums=find_expert_sums(cpu_vm, spec),
                          expert_rows=find_expert_sums(cpu_vm, spec, rows=True),
                          # a prompt's host experts on the same arithmetic as those streamed to the GPU (fp16 GEMMs)
                          int8_prompts=False)
    device = MoeFeedForward(gpu_vm, spec.moe, phases, batch_sizes, to_cupy, from_cupy, signatures=(),
                            expert_signatures=expert_sigs, xp=cp)
    row = batch = None
    if spec.dtype == "float16":         # the one-call sums take fp16 activations on the GPU
        from helmc.runtime.moe_decode_batch import MoeDecodeBatch
        from helmc.runtime.moe_decode_row import MoeDecodeRow
        row = MoeDecodeRow(spec, host._expert_sums, device_expert_sums(gpu_vm, spec, from_cupy), to_cupy, from_cupy)
        batch = MoeDecodeBatch(row, host._expert_rows, device_expert_sums(gpu_vm, spec, from_cupy, rows=True),
                               to_cupy, from_cupy)
    # a prompt's experts on the GPU: the host ones streamed through Plan.memory.expert_staging_bytes (none: those blocks'
    # host experts stay with the CPU)
    from helmc.runtime.moe_prefill import ExpertPrefill, device_bias_bytes
    slots = expert_staging_bytes and expert_staging_bytes - device_bias_bytes(spec.moe, spec.hidden_size,
                                                                              spec.dtype_bytes, len(expert_sigs))
    prefill = ExpertPrefill({j: device._expert[("prefill", j)] for j in set(expert_sigs)}, spec.moe,
                            max(0, slots), to_cupy, from_cupy)
    return GpuMoeFeedForward(gpu_vm, host, device, phases, [spec.signature_index(i) for i in layers], to_cupy,
                             from_cupy, row, prefill, batch)
