"""A streamed group's GPU part of a batched hybrid decode step (runtime/hybrid/batch.py) as CUDA graphs, one per
(group, step shape), replayed per step: group_graph.py's graphs for several sequences; the resident blocks and the
head the same way (decode_graph.DecodeGraph's share of a one-sequence step).

Why: run eagerly, the host enqueued each streamed group's batched work in Relax VM calls and launches
while the CPU waited for it (H200 host, fp16 Qwen3-8B at 8 sequences, 12 one-block groups:
6.4 ms of a 126.6 ms step); a replay is one launch.
What a replay bakes in and what it reads: the group's ring slot (fixed for the session); the static x [S, H],
cos / sin [S, D] of this module (the step writes them first); the batched attention's table of the sequences'
page addresses, steps, partials and splits (GpuDecodeBatch: one device buffer per sequence count B, rewritten each
step before the first group runs) and its output buffer per S; the launch's grid, which depends on S, B and the
step's largest split count: the graph key. A step whose table cannot be made (a sequence's split on host pages)
runs eagerly, as does a key seen for the first time (which also warms TVM's and CuPy's allocators); the second
time it is captured. Eager and replayed steps run the same kernels on the same buffers: every sequence's tokens
are the same whichever ran, and bit-identical to its one-sequence decode (tests/runtime/test_batch_decode_gpu.py).
Each graph's CuPy temporaries come from a pool of its own; TVM's intermediates are safe as group_graph.py says
(one compute stream, no intermediate outlives its launch).
"""
from __future__ import annotations

import warnings

MAX_KEYS = 4        # graphs kept per group: sequences join and leave, and splits grow with the context


class BatchGroupGraphs:
    def __init__(self, stages: list, decode_batch, arrays, stream, to_tvm, to_cupy, hidden: int, rope_width: int):
        """stages: the streamed groups' Stages (bindings on their ring slots); decode_batch: the GpuDecodeBatch
        every GPU stage shares; arrays: the backend's host/device helper; stream: the session's compute stream;
        rope_width: the columns of a RoPE row (ModelSpec.rope_width: a local RoPE's rows hold both tables)."""
        self.stages, self.decode_batch, self.arrays, self.stream = stages, decode_batch, arrays, stream
        self.to_tvm, self.to_cupy, self.hidden, self.rope_width = to_tvm, to_cupy, hidden, rope_width
        self._inputs: dict[int, tuple] = {}                    # S -> (x, cos, sin device arrays, their TVM views)
        # per group, then the resident part: key -> (graph, pool, out tensor, out)
        self._graphs: list[dict] = [{} for _ in range(len(stages) + 1)]
        self._seen: list[set] = [set() for _ in range(len(stages) + 1)]
        self.disabled = ""                                     # why graphs are off ("" while on)
        self.replays = self.captures = self.eager_steps = 0

    def inputs(self, S: int) -> tuple:
        """(x [S, H] fp16, cos [S, W], sin [S, W] fp32 (W = rope_width) on the device, their TVM views), made once per S outside any
        capture: the step writes its rows into them and every graph of S reads them there."""
        if S not in self._inputs:
            import numpy as np
            x = self.arrays.device(np.zeros((S, self.hidden), np.float16))
            cos = self.arrays.device(np.zeros((S, self.rope_width), np.float32))
            sin = self.arrays.device(np.zeros((S, self.rope_width), np.float32))
            self._inputs[S] = (x, cos, sin, tuple(self.to_tvm(a) for a in (x, cos, sin)))
        return self._inputs[S]

    def applies(self, caches: list) -> bool:
        """Whether these sequences' steps go through the shared batched attention (GPU caches on a cubin with its
        kernel), the only path whose launches read nothing from the host; otherwise the group runs eagerly."""
        from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
        return GpuDecodeBatch.applies(caches, self.stages[0].spec.q_dim)

    def run(self, index: int, caches: list, rows: list[int], S: int):
        """Group `index` on the inputs of S rows (x written by the caller) for these sequences -> its output on the
        device (CuPy [S, H]); replayed, captured and launched, or eager."""
        stage = self.stages[index]
        _, _, _, (x, cos, sin) = self.inputs(S)

        def body():
            return stage.forward_batch(x, cos, sin, caches, rows, advance=False)
        return self._run(index, stage, body, caches, S)

    def run_resident(self, stage, head, caches: list, rows: list[int], S: int):
        """The resident blocks (`stage`) and head(x) -> logits [S, V] on the device (CuPy), as run() runs a group;
        the caller commits the caches' step (KVCacheGPU.advance: host bookkeeping and eviction copies, outside
        any graph)."""
        _, _, _, (x, cos, sin) = self.inputs(S)

        def body():
            return head(stage.forward_batch(x, cos, sin, caches, rows, advance=False))
        return self._run(len(self.stages), stage, body, caches, S)

    def _run(self, index: int, stage, body, caches: list, S: int):
        step = self.decode_batch.prepare(caches, S)
        key = None if self.disabled or step.rows is None else (S, len(caches), step.max_splits, step.n_short)
        layers = range(stage.kv_base, stage.kv_base + len(stage.bindings))
        graphs = self._graphs[index]
        if key is not None and key in graphs:
            for kv in caches:
                kv.mark_replayed(layers)
            graph, _, _, out = graphs[key]
            graph.launch(self.stream)
            self.replays += 1
            return out
        if key is not None and key in self._seen[index] and self._capture(index, key, body, caches, layers):
            graph, _, _, out = graphs[key]
            graph.launch(self.stream)
            return out
        if key is not None:
            self._seen[index].add(key)
        self.eager_steps += 1
        return self.to_cupy(body())

    def _capture(self, index: int, key, body, caches: list, layers: range) -> bool:
        """Capture group `index`'s work for `key` (not run: the caller launches it). False, with graphs off for the
        session and the step's appends to these layers forgotten, if the stream cannot be captured."""
        from helmc.runtime.cuda_runtime import capture_graph
        graphs = self._graphs[index]
        if len(graphs) >= MAX_KEYS:
            graphs.pop(next(iter(graphs)))          # the oldest key's graph, then its pool
        try:
            graph, pool, out = capture_graph(self.stream, body)
        except Exception as e:      # a capture that fails enqueued nothing: the step reruns eagerly
            self.disabled = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of a batched streamed group failed, running eagerly: {self.disabled}")
            for kv in caches:
                kv.forget_appends(layers)
            return False
        # the output tensor stays referenced: the graph writes its memory on every replay
        graphs[key] = (graph, pool, out, self.to_cupy(out))
        self.captures += 1
        return True

    def stats(self) -> dict:
        return {"replays": self.replays, "captures": self.captures, "eager": self.eager_steps,
                "disabled": self.disabled}
