"""Hybrid decode of several sequences in one step (serving a hybrid plan; runtime/serve/batch_model.py).

The same schedule as one sequence's (schedule.py: copy S_i, C_i on the CPU, cross, S_i on the GPU from the ring,
cross back, ..., the resident blocks and the head), run by HybridDecode on this backend: each streamed group's
weights cross PCIe once per step for every sequence in it, the CPU groups read their weights once for all rows,
and attention runs per sequence on its slot's caches (Stage.forward_batch). The ring, its copies and events are
the one-sequence backend's (CudaHybridBackend: copy, wait_copy, release_ring), so the copy-after-last-read and
read-after-copy orders are the ones its tests check.

Rows: x [S, H] with S = decode_step_rows(rows, ...) (one token per sequence, padded to a compiled batch size);
each stage runs its decode_b{S} variant, whose rows are bit-identical to one-row decodes, so every sequence's
logits equal its one-sequence hybrid step's. KV: each group appends its blocks' K, V to the slot caches without
committing; the resident part commits the GPU caches' step (every GPU-cache layer, streamed and resident, has
its row by then) and finish() the CPU caches'.
"""
from __future__ import annotations

import numpy as np

from helmc.runtime.stage import batch_phase


class BatchHybridBackend:
    def __init__(self, base, resident_stage, head_fns, head_weights):
        """base: the session's CudaHybridBackend (its ring, copy stream, events, streamed stages and CPU stage);
        resident_stage: the Stage over the GPU-resident blocks (possibly none of them: it still commits the
        GPU caches' step); head_fns / head_weights: the head's compiled phases and bound weights."""
        self.base, self.resident_stage = base, resident_stage
        self.head_fns, self.head_weights = head_fns, head_weights
        self.cpu_caches = self.gpu_caches = self.rows = None
        self.cos = self.sin = self.cos_dev = self.sin_dev = None
        self.graphs = None            # batch_graph.BatchGroupGraphs where the session captures graphs
        if base.graphs:
            from helmc.runtime.hybrid.batch_graph import BatchGroupGraphs
            spec = resident_stage.spec
            self.graphs = BatchGroupGraphs(base.stages, resident_stage.shared_gpu_decode_batch(), base.arrays,
                                           base.graphs[0].stream, base.to_tvm,
                                           base.to_cupy, spec.hidden_size, spec.rope_width)

    def bind(self, cpu_caches: list, gpu_caches: list, rows: list[int]) -> None:
        """The step's sequences: their CPU- and GPU-cache objects and rows (one each)."""
        assert len(cpu_caches) == len(gpu_caches) == len(rows) and all(n == 1 for n in rows), (rows,)
        self.cpu_caches, self.gpu_caches, self.rows = cpu_caches, gpu_caches, rows

    def begin(self, cos: np.ndarray, sin: np.ndarray) -> None:
        arrays, to_tvm = self.base.arrays, self.base.to_tvm
        cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)   # [S, D] each
        self.cos, self.sin = arrays.host_tensor(cos), arrays.host_tensor(sin)
        if self.graphs is not None:            # the static inputs every graph of S rows reads
            _, cos_d, sin_d, (_, self.cos_dev, self.sin_dev) = self.graphs.inputs(cos.shape[0])
            arrays.put(cos_d, cos)
            arrays.put(sin_d, sin)
        else:
            self.cos_dev, self.sin_dev = to_tvm(arrays.device(cos)), to_tvm(arrays.device(sin))

    def copy(self, p) -> None:
        self.base.copy(p)

    def cpu(self, p, x: np.ndarray) -> np.ndarray:
        blocks = range(p.cpu_kv_base, p.cpu_kv_base + len(p.cpu_layers))
        xt = self.base.arrays.host_tensor(np.ascontiguousarray(x, np.float32))     # fp16 from the GPU: exact
        out = self.base.cpu_stage.forward_batch(xt, self.cos, self.sin, self.cpu_caches, self.rows, blocks=blocks,
                                                advance=False)
        return self.base.arrays.host_array(out)

    def to_gpu(self, x: np.ndarray):
        if self.graphs is not None:
            x_d = self.graphs.inputs(x.shape[0])[0]
            self.base.arrays.put(x_d, x)                                           # the host-to-device crossing
            return x_d
        return self.base.arrays.device(np.ascontiguousarray(x, np.float16))

    def wait_copy(self, p) -> None:
        self.base.wait_copy(p)

    def _graphed(self, x) -> bool:
        """Whether this step's GPU part runs through the graphs; if so, x is (now) in their static input."""
        if self.graphs is None or not self.graphs.applies(self.gpu_caches):
            return False
        x_d = self.graphs.inputs(x.shape[0])[0]
        if x is not x_d:
            self.base.arrays.copy(x_d, x)
        return True

    def gpu(self, p, x):
        if self._graphed(x):
            return self.graphs.run(p.index, self.gpu_caches, self.rows, x.shape[0])
        out = self.base.stages[p.index].forward_batch(self.base.to_tvm(x), self.cos_dev, self.sin_dev,
                                                      self.gpu_caches, self.rows, advance=False)
        return self.base.to_cupy(out)

    def release_ring(self, p) -> None:
        self.base.release_ring(p)

    def to_host(self, x) -> np.ndarray:
        return self.base.arrays.get(x)

    def resident(self, x):
        to_tvm, to_cupy = self.base.to_tvm, self.base.to_cupy
        if self._graphed(x):
            S = x.shape[0]
            head = self.head_fns[batch_phase(S)]
            logits = self.graphs.run_resident(self.resident_stage, lambda xt: head(xt, *self.head_weights),
                                              self.gpu_caches, self.rows, S)
            for kv in self.gpu_caches:
                kv.advance(1)                                  # commits the GPU caches' step, as forward_batch does
            return self.base.arrays.get(logits)[:len(self.rows)]                    # [S, V] -> [B, V]: no padding
        xt = self.resident_stage.forward_batch(to_tvm(x), self.cos_dev, self.sin_dev, self.gpu_caches,
                                               self.rows)                            # commits the GPU caches' step
        logits = self.head_fns[batch_phase(x.shape[0])](xt, *self.head_weights)
        return self.base.arrays.get(to_cupy(logits))[:len(self.rows)]              # [S, V] -> [B, V]: no padding

    def finish(self) -> None:
        for kv, n in zip(self.cpu_caches, self.rows):
            kv.advance(n)
