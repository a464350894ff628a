"""A GPU stage's decode step with mixture-of-experts blocks as CUDA graphs between the host's halves.

A block whose experts are (partly) on the CPU waits for the host mid-block: the router's choice must reach the CPU,
and the CPU's sum must come back. So the step is cut after each such block's post_moe into segments; each segment is
captured once and replayed per token (one launch instead of ~20 kernel launches and two Relax VM calls per block
from Python), and between two segments the host does the block's host half (moe_decode_row.MoeDecodeRow):

    segment 0        blocks 0..b0 (attention, post_moe; m and logits copied to pinned memory)
    host             route; launch the block's VRAM-expert graph; the CPU's expert sum into pinned memory
    segment 1        finish block b0 (the CPU's sum crosses, x' = h + sums), blocks b0+1..b1, ...
    last segment     finish, the remaining blocks, the head

Blocks whose experts all live in VRAM are routed on the GPU inside their segment: a model entirely in VRAM is one
graph. The graphs bake in the KV cache's page addresses like DecodeGraph's (graph_key), and every buffer the host
half reads or writes is static (MoeDecodeRow), so a replay and an eager step run the same kernels on the same
buffers: tokens do not depend on which ran.
"""
from __future__ import annotations

from helmc.runtime.decode_graph import DecodeGraph


class MoeDecodeGraph(DecodeGraph):
    @staticmethod
    def applies(stage) -> bool:
        """Every MoE block of the stage runs on its decode row (quantized fp16 experts with the one-call sums)."""
        ffn = stage._moe
        return getattr(ffn, "decode_row", None) is not None and all(
            ffn.row_of(b.post[-1]) is not None for local, b in enumerate(stage.bindings) if stage._moe_layer[local])

    def __init__(self, stage, head_fns, head_weights, spec, stream, to_tvm, to_cupy):
        super().__init__(stage, head_fns, head_weights, spec, stream, to_tvm, to_cupy)
        self.ffn = stage._moe
        self.row = self.ffn.decode_row
        # the blocks that wait on the host end a segment: [(first, end, the ending block's row or None)]
        ends = [local for local, b in enumerate(stage.bindings)
                if stage._moe_layer[local] and not self.ffn.row_of(b.post[-1]).all_vram]
        starts = [0] + [e + 1 for e in ends]
        self.segments = [(a, e + 1, self.ffn.row_of(stage.bindings[e].post[-1])) for a, e in zip(starts, ends)]
        self.segments.append((starts[-1], len(stage.bindings), None))
        # per segment: the selected (row, expert) pairs its blocks route on the GPU (a replay runs no counting code)
        self._routed_on_gpu = [sum(self.row.K for local in range(a, e) if stage._moe_layer[local]
                                   and self.ffn.row_of(stage.bindings[local].post[-1]).all_vram)
                               for a, e, _ in self.segments]
        self.graphs: list = []                   # per segment (graph, pool, output) of the captured key
        self.expert_graphs: dict = {}            # per host block: (graph, pool) of its VRAM experts' launch
        self.segment_replays = 0

    def _segment_body(self, s: int):
        """Segment s's GPU work: finish the block before it (if any), its blocks, the head after the last one."""
        first, end, _ = self.segments[s]
        x, cos, sin, attn = self.views
        if s > 0:
            x = self.row.finish()
        self.ffn.deferred = True
        try:
            x = self.stage.run_blocks(x, cos, sin, "decode", attn_out=(self.attn, attn), blocks=range(first, end))
        finally:
            self.ffn.deferred = False
        return self.head_fns["decode"](x, *self.head_weights) if s == len(self.segments) - 1 else None

    def _layers(self, s: int) -> range:
        first, end, _ = self.segments[s]
        return range(self.stage.kv_base + first, self.stage.kv_base + end)

    def _run(self, key):
        mode = "replay" if key is not None and key == self.key else \
            "capture" if key is not None and key == self.seen else "eager"
        if mode == "capture":
            self.graphs, self.key = [], None         # the old graphs go before their memory pools
        elif mode == "eager":
            self.seen = key
            self.eager_steps += 1
        out = None
        for s, (_, _, row) in enumerate(self.segments):
            if mode == "replay":
                self.stage.kv.mark_replayed(self._layers(s))
                self.row.expert_rows += self._routed_on_gpu[s]     # begin() counts them when it runs
                self.row.gpu_expert_rows += self._routed_on_gpu[s]
                self.graphs[s][0].launch(self.stream)
                self.segment_replays += 1
            elif mode == "capture":
                mode = self._capture_segment(s)
            if mode == "eager":
                out = self._segment_body(s)
            if row is not None:                       # the block that ends the segment waits on the host
                self.stream.synchronize()
                self.ffn.crossings += 1
                self.row.host_half(row, self._gpu_experts if mode != "eager" else None)
        if mode == "eager":
            return self.to_cupy(out)
        if self.key is None:
            self.key, self.logits = key, self.to_cupy(self.graphs[-1][2])
            self.captures += 1
        else:
            self.replays += 1
        return self.logits

    def _capture_segment(self, s: int) -> str:
        """Capture segment s and launch it: "capture", or "eager" (graphs off for the session, the segment's appends
        forgotten so it reruns eagerly) if the stream cannot be captured."""
        from helmc.runtime.cuda_runtime import capture_graph
        pending = self.row.pending
        try:
            graph, pool, out = capture_graph(self.stream, lambda: self._segment_body(s))
        except Exception as e:   # a capture that fails enqueued nothing
            import warnings
            self.row.pending = pending
            self.disabled = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of the decode step failed, decoding without graphs: {self.disabled}")
            self.stage.kv.forget_appends(self._layers(s))
            self.graphs, self.key = [], None
            return "eager"
        self.graphs.append((graph, pool, out))
        graph.launch(self.stream)
        return "capture"

    def _gpu_experts(self, row) -> None:
        """The block's VRAM experts as a graph of their own (captured on first use: it depends on no page)."""
        from helmc.runtime.cuda_runtime import capture_graph
        key = id(row.experts)
        if key not in self.expert_graphs:
            graph, pool, _ = capture_graph(self.stream, lambda: self.row.gpu_experts(row))
            self.expert_graphs[key] = (graph, pool)
        self.expert_graphs[key][0].launch(self.stream)
