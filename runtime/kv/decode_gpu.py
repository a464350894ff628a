"""The GPU KV cache's decode attention (a base of KVCacheGPU, cache_gpu.py): one query row over the paged keys.

One table of page addresses per layer; resident pages are read in place, host pages are copied into staging half
by half on the copy stream (GpuPageStore._staged: events order copy -> kernel -> reuse). Up to SHORT_MAX_TOKENS of
pages one block per query head reads the whole window (paged_decode_short), else splits of whole pages (or page
parts); both fixed by the page count alone (decode_splits.plan_splits), so offload never changes the result.
Where every split of the window is on the device, one launch covers them all (paged_decode_fused), and the step's
new row, left by append in `_rows`, is written by that same launch. A layer's attention sinks (KVCacheGPU.layer_sinks)
go to whichever launch writes the output: the short kernel, the fused one, or the merge.
"""
from __future__ import annotations

import numpy as np

from helmc.runtime.kv.decode_splits import plan_splits, short_path, runs


class GpuDecode:
    def _split_plan(self, table):
        """decode_splits.plan_splits for this page layout, cached per layout (see there)."""
        n_pages = table.n_pages
        key = (self.pool.version, n_pages)
        if key != self._plan_key:
            self._plan = plan_splits(n_pages, self.T, self.num_sms, self.h_kv, self.staging_pages, table.on_device)
            self._plan_key = key
            self._ptr_tables.clear()
        return self._plan

    def _page_ptrs(self, layer: int, table, stage_of):
        """Device int64 [n_pages]: where each page's `layer` slice will be when the kernel reads it."""
        if layer not in self._ptr_tables:
            ptrs = np.empty(table.n_pages, np.int64)
            stage_base = self.ops.ptr(self.staging) if self.staging is not None else 0
            for i in range(table.n_pages):
                if table.on_device(i):
                    ptrs[i] = self._gpu_ptr(table.gpu_slots[i]) + layer * self.slice_elems * 2
                else:
                    ptrs[i] = stage_base + stage_of[i] * self.slice_elems * 2
            self._ptr_tables[layer] = self.ops.to_device(ptrs)
        return self._ptr_tables[layer]

    def _decode(self, layer: int, q, scale: float, out=None):
        xp, ops = self.xp, self.ops
        h_a = q.shape[1]
        table = self._table()
        split_plan = self._split_plan(table)
        span, n_splits, _, _, stage_of = split_plan
        ptrs = self._page_ptrs(layer, table, stage_of)
        one_launch, first = self._one_launch(split_plan, self.windows[layer])
        pm, ps, po = self._partials(n_splits, h_a)
        q16 = xp.ascontiguousarray(q[0], dtype=np.float16)               # [1, h_a, d] -> [h_a, d]
        res = xp.empty((h_a, self.d), np.float16) if out is None else out.reshape(h_a, self.d)   # [h_a*d] -> [h_a, d]
        row = self._rows.pop(layer, None)
        step = self.step_for(layer)
        short = self._short(table, h_a)
        sinks = self.layer_sinks(layer, h_a)
        if short and not one_launch:         # some pages on the host: all of them staged in one chunk, then one launch
            _, _, _, chunks, _ = split_plan
            assert len(chunks) == 1 and row is None, "KVCacheGPU._decode: short-path host pages fit one chunk"
            with self._staged(layer, table, chunks[0][1], stage_of, self._after_host_writes()):
                ops.decode_short(q16, ptrs, self.T, step, self.h_kv, self.d, scale, res, sinks)
        elif short:                          # a row append left to this launch (one_launch held there) goes in it
            ops.decode_short(q16, ptrs, self.T, step, self.h_kv, self.d, scale, res, sinks) if row is None else \
                ops.decode_short_append(q16, *row, ptrs, self.T, step, self.h_kv, self.d, scale, res, sinks)
        elif row is not None:
            assert one_launch, "KVCacheGPU._decode: a deferred row needs the one-launch path"
            ops.decode_fused_append(q16, row[0], row[1], ptrs, self.T, step, span, first, n_splits - first,
                                    self.h_kv, self.d, scale, pm, ps, po, self._counters, res, sinks)
        elif one_launch and ops.has_fused_decode(self.d, h_a // self.h_kv):   # one launch for all splits
            ops.decode_fused(q16, ptrs, self.T, step, span, first, n_splits - first, self.h_kv, self.d,
                             scale, pm, ps, po, self._counters, res, sinks)
        else:
            self._decode_in_parts(layer, table, q16, ptrs, scale, first, res, sinks)
        res = res.reshape(1, h_a, self.d)                                  # [h_a, d] -> [1, h_a, d]
        return res if q.dtype == np.float16 else res.astype(q.dtype)

    def _short(self, table, h_a: int) -> bool:
        """Whether this step's attention is paged_decode_short's (decode_splits.short_path, and the cubin has it)."""
        return short_path(table.n_pages, self.T, self.staging_pages) and self.ops.has_short_decode(self.d, h_a // self.h_kv)

    def _partials(self, n_splits: int, h_a: int) -> tuple:
        """The split partials (m, s, o) for n_splits splits of h_a heads, grown (never shrunk) as contexts grow."""
        if self._parts is None or self._parts[0].shape[0] < n_splits * h_a:
            rows = max(n_splits, 64) * h_a
            self._parts = tuple(self.xp.empty(n, np.float32) for n in (rows, rows, rows * self.d))
        return self._parts

    def _one_launch(self, split_plan, window: int) -> tuple[bool, int]:
        """(whether one launch covers this decode step's splits -- none of them on host pages --, the first split
        the window keeps)."""
        span, _, host_split, _, _ = split_plan
        n = self.length + 1
        first = (max(0, n - window) // span) if window else 0
        return not any(host_split[first:]), first

    def _decode_in_parts(self, layer: int, table, q16, ptrs, scale: float, first: int, res, sinks) -> None:
        """_decode's splits [first, n_splits) as partials -- the resident runs at once, the host pages' splits as
        their pages arrive in the staging slots -- then their merge into res [h_a, d] (which adds the sinks)."""
        ops, h_a = self.ops, q16.shape[0]
        span, n_splits, host_split, chunks, stage_of = self._split_plan(table)
        pm, ps, po = self._parts
        step = self.step_for(layer)

        def launch(s0, s1):
            ops.decode_partial(q16, ptrs, self.T, step, span, s0, s1 - s0, self.h_kv, self.d, scale, pm, ps, po)

        for s0, s1 in runs(sp for sp in range(first, n_splits) if not host_split[sp]):   # resident: no waiting
            launch(s0, s1)
        todo = [(splits, pages) for splits, pages in chunks if splits[-1] >= first]
        compute = self._after_host_writes() if todo else None
        for splits, pages in todo:
            with self._staged(layer, table, pages, stage_of, compute):
                for s0, s1 in runs(sp for sp in splits if sp >= first):
                    launch(s0, s1)
        ops.decode_merge(pm, ps, po, first, n_splits, h_a, self.d, h_a // self.h_kv, res, sinks)
