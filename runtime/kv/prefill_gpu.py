"""The GPU KV cache's prefill attention (a base of KVCacheGPU, cache_gpu.py): a step of several rows.

A fresh prompt (no cached keys) and a later chunk take the bundle's tensor-core kernel (CudaOps.flash_prefill,
schedules/gpu/flash_prefill.py): device pages read in place through a table of their addresses, host pages (the
oldest: a prefix) staged staging_pages at a time on the copy stream with the softmax state carried between the
launches, the chunk's own rows in the last launch. Where the cubin lacks the kernel (or pages are not whole
64-token tiles), a fresh fp16 prompt of up to PREFILL_MAX_TOKENS takes prefill_causal, and otherwise
attend_blocks walks KeyBlocks: device pages in place, host pages staged one at a time into a ring of the staging
slots (GpuPageStore._stage_one), and this step's own rows; no S x S buffer. The step's own K, V rows come as an
argument (append keeps them); pages are read through the page store's addresses and staging.
"""
from __future__ import annotations

import numpy as np

from helmc.runtime.kv.cuda_ops import PREFILL_MAX_TOKENS
from helmc.runtime.kv.paged_attention import KeyBlock, attend_blocks, contiguous_blocks


class GpuPrefill:
    def _prefill(self, layer: int, q, kv, scale: float):
        """Causal attention of the step's rows q [S, h_a, d] over the cached pages and the step's own kv [2, h_kv, S, d]."""
        xp, ops = self.xp, self.ops
        start, T = self.length, self.T
        flash = q.dtype == np.float16 and self._has_flash(q.shape[1])
        sinks = self.layer_sinks(layer, q.shape[1])
        if start == 0 and (flash or (q.shape[0] <= PREFILL_MAX_TOKENS and q.dtype == np.float16)):
            # a fresh prompt: every key is this step's own; one kernel where the tiles below take ~20 launches
            kv = xp.ascontiguousarray(kv)                                    # [2, h_kv, S, d]
            out = xp.empty(q.shape, np.float16)                              # [S, h_a, d]
            if flash:
                ops.flash_prefill(xp.ascontiguousarray(q), kv[0], kv[1], q.shape[0], 0, self.h_kv, self.windows[layer],
                                  scale, out, sinks=sinks)
            else:
                ops.prefill_causal(xp.ascontiguousarray(q), kv, self.h_kv, self.d, self.windows[layer], scale, out,
                                   sinks)
            return out
        table = self._table()
        before = -(-start // T)                                            # pages holding keys 0..start-1
        host = next((i for i in range(before) if table.on_device(i)), before)   # leading host pages (I6: a prefix)
        if (flash and start % 64 == 0 and T % 64 == 0 and all(table.on_device(i) for i in range(host, before))
                and (host == 0 or self.staging_pages > 0)):
            return self._flash_later_chunk(layer, q, kv, scale, table, host, before, sinks)
        blocks: list[KeyBlock] = []
        compute = ops.current_stream()
        for i in range(before):
            n_i = min(T, start - i * T)
            if table.on_device(i):
                page = self.gpu_store[table.gpu_slots[i], layer]             # [2, h_kv, T, d]
                blocks.append(KeyBlock(i * T, n_i, (lambda page=page, n_i=n_i: (page[0, :, :n_i], page[1, :, :n_i]))))
            else:
                blocks.append(KeyBlock(i * T, n_i, (lambda i=i, n_i=n_i: self._stage_one(layer, table, i, n_i, compute))))
        blocks += contiguous_blocks(kv[0], kv[1], start, self.prefill_block_tokens)
        out = attend_blocks(xp, q, start, blocks, self.h_kv, scale, self.windows[layer], np.float32, self.score_budget_bytes,
                            sinks=sinks)
        self._release_ring(compute)
        return out

    def _flash_later_chunk(self, layer: int, q, kv, scale: float, table, host: int, before: int, sinks):
        """A later chunk on the tensor-core kernel: the host pages [0, host) staged staging_pages at a time, a launch
        per group carrying the softmax state, then the device pages [host, before) read in place through a page
        table and the chunk's own rows in the last launch, which writes the output (the first launch, reading no
        state, starts from the sinks)."""
        xp, ops, T, start = self.xp, self.ops, self.T, self.length
        q = xp.ascontiguousarray(q)
        n, h_a = q.shape[0], q.shape[1]
        kv = xp.ascontiguousarray(kv)                                        # [2, h_kv, n, d]
        out = xp.empty(q.shape, np.float16)                                  # [n, h_a, d]
        state = xp.empty((n, h_a, self.d + 2), np.float32) if host else None  # o, m, l of each row between launches
        compute = ops.current_stream()
        if host:
            written = ops.new_event()
            ops.record(written, compute)                                      # host pages written by earlier steps
            ops.wait(self.copy_stream, written)
        slice_bytes, staging = self.slice_elems * 2, ops.ptr(self.staging) if host else 0
        for g0 in range(0, host, self.staging_pages):
            group = list(range(g0, min(host, g0 + self.staging_pages)))
            stage_of = {i: i - g0 for i in group}
            ptrs = np.array([staging + stage_of[i] * slice_bytes for i in group], np.int64)
            with self._staged(layer, table, group, stage_of, compute):
                ops.flash_prefill(q, kv[0], kv[1], len(group) * T, start, self.h_kv, self.windows[layer], scale, out,
                                  ops.to_device(ptrs), T, len(group) * T, k_pos0=g0 * T, state=state,
                                  state_in=g0 > 0, state_out=True, sinks=sinks)
        ptrs = np.array([self._gpu_ptr(table.gpu_slots[i]) + layer * slice_bytes for i in range(host, before)] or [0],
                        np.int64)
        ops.flash_prefill(q, kv[0], kv[1], start - host * T + n, start, self.h_kv, self.windows[layer], scale, out,
                          ops.to_device(ptrs), T, start - host * T, k_pos0=host * T, state=state, state_in=host > 0,
                          sinks=sinks)
        return out

    def _has_flash(self, num_heads: int) -> bool:
        """Whether the ops have the tensor-core prefill attention for this cache's head_dim and query group."""
        return self.ops.has_flash(self.d, num_heads // self.h_kv)
