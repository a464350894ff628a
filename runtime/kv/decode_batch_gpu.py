"""Attention of a batched decode step on GPU caches: one kernel launch per layer for every sequence.

Stage.forward_batch serves several sequences a step, each on its own KVCacheGPU (a slot's page pool). Per layer,
append + attend per sequence and a concatenate cost a few launches and ~10 Python calls per sequence: hundreds per
step at batch 8 over ~23 GPU layers. GpuDecodeBatch launches paged_decode_fused_append_batch once per layer
instead (schedules/gpu/paged_attention.py): block row z is sequence z's paged_decode_fused_append, on its own page
table, step array, splits, partials and counters, so each sequence gets the bits of its one-sequence decode. The
sequences whose page count takes the short kernel alone (decode_splits.short_path) are marked n_splits 0 and get
paged_decode_short_append_batch's launch instead (a step of both kinds launches both, each skipping the other's).

What each sequence's launch needs comes from a table [L, B, SEQ_FIELDS] int64 on the device, built once a step
(when any cache's page table changed, as it does at every step) from what KVCacheGPU.begin_step already made: each
layer's page address table, the step's [n_tokens, t_begin], the split plan. Per layer the host marks the layer
appended in each cache and launches.

Applies only where every sequence's step is on the path that one fused launch handles (no split of the step's
window reads a host page); otherwise attend returns None and the caller runs the per-sequence append + attend.
"""
from __future__ import annotations

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.kv.cache_gpu import KVCacheGPU

# A row of the sequences' table: int64 fields in this order (= schedules/gpu/paged_attention.SEQ_FIELDS, which the
# kernel's source #defines; tests/kernels/test_paged_attention_cuda_emulated.py checks the three agree)
SEQ_FIELDS = ("page_ptrs", "step", "part_m", "part_s", "part_o", "counters", "split_tokens", "split_base", "n_splits")


def _same_sinks(a, b) -> bool:
    """Whether two caches' per-layer sinks (KVCacheGPU.sinks: host vectors, or None) are equal."""
    if a is None or b is None:
        return a is b
    return a is b or (len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)))


class _StepTable:
    """The sequences' table of one step and what it was built from (held, so no identity is reused while it lives)."""

    def __init__(self, caches, tables, parts, rows, max_splits, n_short):
        self.caches, self.tables, self.parts = caches, tables, parts
        self.rows, self.max_splits = rows, max_splits        # rows: device [L, B, SEQ_FIELDS] int64, or None
        self.n_short = n_short                               # sequences on the short kernel (their n_splits field 0)

    def holds(self, caches, tables) -> bool:
        return (len(caches) == len(self.caches) and all(a is b for a, b in zip(caches, self.caches))
                and all(a is b for a, b in zip(tables, self.tables))
                and all(kv._parts is p for kv, p in zip(caches, self.parts)))


class GpuDecodeBatch:
    def __init__(self, num_q_heads: int, head_dim: int, to_array, from_array):
        """to_array / from_array: the GPU stage's (a TVM device tensor <-> a CuPy array over the same memory)."""
        self.h_a, self.d = num_q_heads, head_dim
        self.to_array, self.from_array = to_array, from_array
        self._step: _StepTable | None = None
        self._outs: dict[int, list] = {}     # rows S -> [out [S, h_a*d] fp16, its tensor, rows that may be non-zero]
        # sequences B -> the device table [L, B, SEQ_FIELDS] int64 every step of B sequences writes: one address,
        # so a CUDA graph of a batched step (hybrid/batch_graph.py) reads each step's table where it was captured
        self._rows_dev: dict[int, object] = {}

    @staticmethod
    def applies(caches: list, q_dim: int) -> bool:
        """Every cache a KVCacheGPU of one shape on one CudaOps whose cubin has the batched kernel, one window for
        all its layers (the launch reads one [n_tokens, t_begin] per sequence), and the same attention sinks (the
        launch takes one layer's for every sequence: the first cache's)."""
        first = caches[0]
        if not all(isinstance(kv, KVCacheGPU) and len(set(kv.windows)) == 1 for kv in caches):
            return False
        shape = (first.ops, first.L, first.h_kv, first.d, first.T)
        if any((kv.ops, kv.L, kv.h_kv, kv.d, kv.T) != shape or not _same_sinks(kv.sinks, first.sinks) for kv in caches):
            return False
        return first.ops.has_fused_append_batch(first.d, q_dim // (first.h_kv * first.d))

    def attend(self, caches: list, layer: int, q, k, v, scale: float):
        """q [S, h_a, d], k, v [S, h_kv, d] (or each [S, h*d]) fp16 device tensors, row b < len(caches) caches[b]'s
        new token, the rest padding: appends each row's K, V to its cache and returns the [S, h_a*d] attention outputs
        (padding rows zero) as a tensor over this object's buffer, which the next call overwrites (stream order: the
        caller's work on it is enqueued first). None when some sequence's step needs the per-sequence path (a split
        of its window on host pages; q, k, v not contiguous fp16): then the caller appends and attends per sequence
        (in the steps opened here, if any)."""
        B, S = len(caches), q.shape[0]
        q, k, v = self.to_array(q), self.to_array(k), self.to_array(v)
        if any(a.dtype != np.float16 or not a.flags.c_contiguous for a in (q, k, v)):
            return None          # the kernel reads contiguous fp16 (the GPU stage's); other stages' rows go per sequence
        for kv in caches:
            if not 0 <= layer < kv.L or layer in kv._appended or kv._pending > 1:
                raise HelmcError(f"GpuDecodeBatch: layer {layer} expected once per decode step in 0..{kv.L - 1}, "
                                 f"found a step of {kv._pending} rows with layers {sorted(kv._appended)} appended")
            if kv._pending == 0:
                kv.begin_step(1)
        step = self._step_table(caches)
        if step.rows is None:
            return None
        q, k, v = q.reshape(S, -1), k.reshape(S, -1), v.reshape(S, -1)    # [S, h, d] or [S, h*d] -> [S, h*d]
        out = self._out(S, B, caches[0].xp)
        first = caches[0]
        ops = first.ops
        row_bytes = step.rows.strides[0]
        rows = ops.ptr(step.rows) + layer * row_bytes
        sinks = first.layer_sinks(layer, self.h_a)              # applies(): every cache's are these
        if step.n_short:
            ops.decode_short_append_batch(q, k, v, rows, B, first.T, first.h_kv, first.d, scale, out[0], sinks)
        if step.max_splits:
            ops.decode_fused_append_batch(q, k, v, rows, B, step.max_splits, first.T, first.h_kv, first.d, scale, out[0],
                                          sinks)
        for kv in caches:
            kv._appended.add(layer)          # the launch wrote its row: what append + attend leave behind
        return out[1]

    def _out(self, S: int, B: int, xp) -> list:
        """The output buffer for S rows with rows B.. zero (the kernel writes rows < B only)."""
        if S not in self._outs:
            a = xp.zeros((S, self.h_a * self.d), np.float16)
            self._outs[S] = [a, self.from_array(a), 0]
        out = self._outs[S]
        if out[2] > B:
            out[0][B:out[2]] = 0
        out[2] = B
        return out

    def _step_table(self, caches) -> _StepTable:
        """The sequences' table of this step (built at its first layer, kept while every cache's page table, hence
        its page addresses, split plan and step, is the one it was built from)."""
        tables = [kv._table() for kv in caches]
        if self._step is not None and self._step.holds(caches, tables):
            return self._step
        B, first = len(caches), caches[0]
        host = np.empty((first.L, B, len(SEQ_FIELDS)), np.int64)
        max_splits, n_short, ok = 0, 0, True
        for b, (kv, table) in enumerate(zip(caches, tables)):
            split_plan = kv._split_plan(table)
            span, n_splits, _, _, stage_of = split_plan
            one_launch, split_base = kv._one_launch(split_plan, kv.windows[0])
            if not one_launch:
                ok = False
                break
            short = kv._short(table, self.h_a)       # its step is paged_decode_short's, as alone: n_splits 0 says so
            pm, ps, po = kv._partials(n_splits, self.h_a)
            fixed = [kv.ops.ptr(kv._step_dev), kv.ops.ptr(pm), kv.ops.ptr(ps), kv.ops.ptr(po), kv.ops.ptr(kv._counters),
                     span, split_base, 0 if short else n_splits - split_base]
            for layer in range(kv.L):
                host[layer, b] = [kv.ops.ptr(kv._page_ptrs(layer, table, stage_of))] + fixed
            n_short += short
            max_splits = max(max_splits, 0 if short else n_splits - split_base)
        assert not ok or max_splits >= 1 or n_short == B, "a decode step has at least one split or the short kernel"
        rows = None
        if ok:
            rows = self._rows_dev.get(B)
            if rows is None or rows.shape != host.shape:
                rows = self._rows_dev[B] = first.ops.device_empty(host.shape, np.int64)
            # stream order: the last step's kernels have read the table before this overwrites it
            first.ops.write(rows, host, first.ops.current_stream())
        self._step = _StepTable(list(caches), tables, [kv._parts for kv in caches], rows, max_splits, n_short)
        return self._step

    def prepare(self, caches: list, S: int):
        """Before a captured or replayed step of these sequences: each cache's step opened, the step's table
        written and the output buffer for S rows made, so that the capture records only kernels. The step's
        _StepTable (rows None: a sequence needs the per-sequence path, no graph)."""
        for kv in caches:
            if kv._pending == 0:
                kv.begin_step(1)
        step = self._step_table(caches)
        if step.rows is not None:
            self._out(S, len(caches), caches[0].xp)
        return step
