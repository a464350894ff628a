"""A streamed group's GPU part (its blocks, computed from their ring slot) captured once as a CUDA graph and replayed
per token, as decode_graph.DecodeGraph does for the resident blocks and the head.

Why: run eagerly, each streamed block cost ~0.47 ms of host time a token in launches and Relax VM calls
against ~0.1 ms of kernels (H200 host, fp16 Qwen3-8B, 5 pairs of 2 streamed blocks: 4.70 ms of
`gpu` and 3.12 of `to_host` a token, which waits for those launches' kernels), and the CPU waits for all of it: the
CPU groups and the streamed groups take turns. A replay is one launch.
What a replay may bake in: the ring slot (fixed per group for the session), the backend's static x, cos, sin and
attention buffers (the step's inputs are written into them before the launch), and the GPU cache's page addresses
(KVCacheGPU.graph_key names them; a key seen the first time runs eagerly, which also warms TVM's and CuPy's
allocators, the second captures, a step that cannot replay runs eagerly). The copy into the slot is ordered before
the launch by the backend's copied[i] event on the same compute stream. Eager and replayed steps run the same
kernels on the same buffers: tokens do not depend on which ran.
TVM's own intermediate buffers, freed after a capture, may be handed to other work (another group's capture, the
resident graph, an eager step): safe because everything of a step runs in order on the one compute stream and no
graph's intermediate outlives its launch; the output, which does, stays referenced here.
"""
from __future__ import annotations

import warnings


class GroupGraph:
    def __init__(self, stage, views, attn, stream, to_cupy):
        """stage: the group's Stage (bindings on its ring slot, kv the GPU cache); views: TVM views of the backend's
        (x, cos, sin, attn) device buffers, made once outside captures; attn: the CuPy attention buffer; stream: the
        session's compute stream (the one the backend's ops run on)."""
        self.stage, self.views, self.attn, self.stream, self.to_cupy = stage, views, attn, stream, to_cupy
        self.layers = range(stage.kv_base, stage.kv_base + len(stage.bindings))   # the cache layers it appends
        self.graph = self.pool = self.key = self.seen = self.out = self._out_tensor = None
        self.disabled = ""                     # why this group runs without a graph ("" while it may have one)
        self.replays = self.captures = self.eager_steps = 0

    @property
    def kv(self):
        return self.stage.kv        # not kept here: serving several sequences drops the stages' cache (BatchModel)

    def _body(self):
        x, cos, sin, attn = self.views
        return self.stage.run_blocks(x, cos, sin, "decode", attn_out=(self.attn, attn))

    def run(self):
        """The group's blocks on the backend's x (device, fp16 [1, H]) -> its output on the device (CuPy)."""
        key = None if self.disabled else self.kv.graph_key()
        if key is not None and key == self.key:
            self.kv.mark_replayed(self.layers)
            self.graph.launch(self.stream)
            self.replays += 1
            return self.out
        if key is not None and key == self.seen and self._capture(key):
            self.graph.launch(self.stream)
            return self.out
        self.seen = key
        self.eager_steps += 1
        return self.to_cupy(self._body())

    def _capture(self, key) -> bool:
        """Capture the group's work (not run yet: run launches it). False, with this group's graph off for the
        session and the step's appends to its layers forgotten, if the stream cannot be captured."""
        from helmc.runtime.cuda_runtime import capture_graph
        self.graph = self.out = self._out_tensor = None         # the old graph goes before its memory pool
        try:
            graph, pool, out = capture_graph(self.stream, self._body)
        except Exception as e:   # a capture that fails enqueued nothing: the step reruns eagerly
            self.disabled = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of a streamed group failed, running it eagerly: {self.disabled}")
            self.kv.forget_appends(self.layers)
            return False
        # the output tensor stays referenced: the graph writes its memory on every replay
        self.graph, self.pool, self.key, self._out_tensor = graph, pool, key, out
        self.out = self.to_cupy(out)
        self.captures += 1
        return True
