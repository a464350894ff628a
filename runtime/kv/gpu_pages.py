"""The GPU KV cache's page storage and staging: the device page pool, the pinned host extents, the staging
slots and the copy stream between them (a base of KVCacheGPU, cache_gpu.py).

Buffers (placement decided by pages.PagePool, whose invariants are stated and asserted there):
  gpu_store [C, L, 2, h_kv, T, d] fp16 on the GPU; a slot holds one page for all L layers.
  host      pinned extents of `extent_pages` pages, same page layout, pinned on first use.
  staging   [staging_pages, 2, h_kv, T, d] fp16 on the GPU: one layer of a host page, for attention.
Eviction: pages above the watermark are copied device-to-host on the copy stream, off the critical path; their GPU
slot is freed when the copy's event has completed (polled at the next step, waited only when short). Staging: host
pages' layer slices copied into staging slots on the copy stream, events ordering copy -> reader -> reuse.
Every copy and event goes through the device ops (cuda_ops.CudaOps, or the tests' emulator).
"""
from __future__ import annotations

import contextlib

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.kv.cuda_ops import D2H, H2D
from helmc.runtime.kv.pages import PagePool, PoolExhausted
from helmc.runtime.memory.allocation import allocate


class GpuPageStore:
    """Page storage, eviction and staging over `self.ops`; the attention bases read pages through its addresses."""

    def _init_store(self, ops, geometry: tuple[int, int, int, int], max_tokens: int, *, vram_bytes: int | None,
                    gpu_pages: int | None, watermark: float, offload: bool, staging_pages: int,
                    host_extent_pages: int, loan_bytes: int) -> None:
        """Size and allocate the pool for `max_tokens` tokens of geometry (layers, kv heads, head_dim, page tokens):
        every page on the device without offload, else the watermark's share of what fits."""
        num_layers, num_kv_heads, head_dim, page_tokens = geometry
        self.ops, self.xp = ops, ops.xp
        self.L, self.h_kv, self.d, self.T = geometry
        self.max_tokens, self.offload = max_tokens, offload
        self.staging_pages, self.extent_pages = staging_pages, host_extent_pages
        self.slice_elems = 2 * num_kv_heads * page_tokens * head_dim      # one layer of one page
        self.page_bytes = 2 * num_layers * self.slice_elems               # fp16
        needed = -(-max_tokens // page_tokens)
        fit = gpu_pages if gpu_pages is not None else (vram_bytes // self.page_bytes if vram_bytes is not None
                                                      else needed)
        if not offload:
            capacity = resident = needed
            if vram_bytes is not None and capacity * self.page_bytes > vram_bytes:
                raise HelmcError(f"KV cache (GPU layers, --no-kv-offload): {max_tokens} tokens need "
                                 f"{capacity * self.page_bytes / 2**30:.2f} GiB of VRAM, {vram_bytes / 2**30:.2f} GiB free")
        else:
            from helmc.runtime.kv.capacity import gpu_resident_pages
            resident = gpu_resident_pages(fit, watermark, needed)
            if resident < 1:
                raise HelmcError(f"KV cache (GPU layers): offloading needs VRAM for 2 pages ({2 * self.page_bytes / 2**20:.1f} "
                                 f"MiB: one resident, one being written), found room for {fit}")
            capacity = min(needed, fit)
        self.pool = PagePool(page_tokens, capacity, needed if offload else 0, resident,
                             staging_pages if offload else 0)
        # Bytes past the `capacity` slots hold no page: they are there only for lend_empty_pool.
        room = vram_bytes if vram_bytes is not None else fit * self.page_bytes
        self.vram_budget = room          # what the pool may take (the store holds only the slots it needs)
        store_bytes = max(capacity * self.page_bytes, min(max(0, loan_bytes), room))
        self._store = allocate("kv", store_bytes, lambda: ops.device_empty((-(-store_bytes // 2),), np.float16),
                               "GPU page pool")
        self.gpu_store = self._store[:capacity * self.page_bytes // 2].reshape(
            capacity, num_layers, 2, num_kv_heads, page_tokens, head_dim)          # [bytes/2] -> [C, L, 2, h_kv, T, d]
        # Invariant: the store holds the loan whenever its VRAM does (the plan counts the loan as the pool's floor).
        assert self._store.nbytes >= min(loan_bytes, room), (store_bytes, loan_bytes, room)
        self.staging = (ops.device_empty((staging_pages, 2, num_kv_heads, page_tokens, head_dim), np.float16)
                        if offload else None)
        self._extents: list = []
        self.copy_stream = ops.new_stream()
        self._evict_events: dict[int, object] = {}
        self._slot_events: list = [None] * staging_pages
        self._ring = 0
        self._ring_used: int | None = None

    def _drain_copies(self) -> None:
        """Wait for the copy stream, end every staging and eviction in flight (a new sequence)."""
        self.ops.synchronize_stream(self.copy_stream)
        for slot in self.pool.staged():
            self.pool.end_prefetch(slot)
        self._ring_used = None
        for pid in self.pool.in_flight():
            self.pool.complete_eviction(pid)
        self._evict_events.clear()

    # ------------------------------------------------------------------ eviction
    def _copy_out(self, page_ids) -> None:
        """Enqueue device-to-host copies of whole pages (all layers) after the compute stream's writes."""
        written = self.ops.new_event()
        self.ops.record(written, self.ops.current_stream())
        self.ops.wait(self.copy_stream, written)
        for pid in page_ids:
            info = self.pool.page_info(pid)
            self.ops.memcpy(self._host_ptr(info.host_slot), self._gpu_ptr(info.gpu_slot), self.page_bytes,
                            D2H, self.copy_stream)
            done = self.ops.new_event()
            self.ops.record(done, self.copy_stream)
            self._evict_events[pid] = done

    def _complete_evictions(self, block: bool, want: int = 0) -> None:
        """Free the GPU slots of finished evictions, oldest first; with block, wait until `want` GPU
        slots are free or nothing is in flight."""
        for pid in self.pool.in_flight():
            ev = self._evict_events[pid]
            if not self.ops.query(ev):
                if not block or self.pool.gpu_free >= want:
                    return
                self.ops.synchronize(ev)
            self.pool.complete_eviction(pid)
            del self._evict_events[pid]

    def _make_room(self, want: int) -> None:
        """Ensure `want` free GPU slots: finished evictions first, then waiting, then forced evictions."""
        while self.pool.gpu_free < want:
            if self.pool.in_flight():
                self._complete_evictions(block=True, want=want)
                continue
            victims = self.pool.evictable()
            if not victims:
                raise PoolExhausted(f"KV cache (GPU layers): {want} free page slot(s) needed, "
                                    f"{self.pool.gpu_free} free and nothing can be evicted")
            self.pool.begin_eviction(victims[0])
            self._copy_out([victims[0]])

    def _after_host_writes(self):
        """The copy stream waits for the compute stream's work so far (host pages written this step); returns it."""
        compute, written = self.ops.current_stream(), self.ops.new_event()
        self.ops.record(written, compute)
        self.ops.wait(self.copy_stream, written)
        return compute

    @contextlib.contextmanager
    def _staged(self, layer: int, table, pages, stage_of, compute):
        """Host `pages`' `layer` slices in their staging slots (stage_of) for the compute work enqueued inside
        the block: the copies first on the copy stream, compute waits for them, then the slots are marked
        read by that work and free for the next copy into them."""
        ops = self.ops
        self._stage(layer, table, pages, stage_of)
        ready = ops.new_event()
        ops.record(ready, self.copy_stream)
        ops.wait(compute, ready)
        yield
        used = ops.new_event()
        ops.record(used, compute)
        for i in pages:
            self._slot_events[stage_of[i]] = used
            self.pool.end_prefetch(stage_of[i])

    def _stage(self, layer: int, table, pages, stage_of) -> None:
        """Copy `layer`'s slice of host pages into their staging slots on the copy stream, a run of
        consecutive host slots (one extent) and staging slots per 2-D copy."""
        for i in pages:
            ev = self._slot_events[stage_of[i]]
            if ev is not None:
                self.ops.wait(self.copy_stream, ev)                       # its previous reader is done
            self.pool.begin_prefetch(table.page_ids[i], layer, stage_of[i])
        slice_bytes = self.slice_elems * 2
        j = 0
        while j < len(pages):
            h0, s0 = table.host_slots[pages[j]], stage_of[pages[j]]
            k = j + 1
            while (k < len(pages) and table.host_slots[pages[k]] == h0 + (k - j) and stage_of[pages[k]] == s0 + (k - j)
                   and (h0 + k - j) // self.extent_pages == h0 // self.extent_pages):
                k += 1
            self.ops.memcpy2d(self.ops.ptr(self.staging) + s0 * slice_bytes, slice_bytes,
                              self._host_ptr(h0) + layer * slice_bytes, self.page_bytes,
                              slice_bytes, k - j, H2D, self.copy_stream)
            j = k
    def _stage_one(self, layer: int, table, i: int, n_i: int, compute):
        """One cached host page for prefill: a ring of staging slots, each reused after its reader."""
        ops = self.ops
        self._release_ring(compute)
        slot = self._ring % self.staging_pages
        self._ring += 1
        written = ops.new_event()
        ops.record(written, compute)
        ops.wait(self.copy_stream, written)
        if self._slot_events[slot] is not None:
            ops.wait(self.copy_stream, self._slot_events[slot])
        self.pool.begin_prefetch(table.page_ids[i], layer, slot)
        slice_bytes = self.slice_elems * 2
        ops.memcpy(ops.ptr(self.staging) + slot * slice_bytes, self._host_ptr(table.host_slots[i]) + layer * slice_bytes,
                   slice_bytes, H2D, self.copy_stream)
        ready = ops.new_event()
        ops.record(ready, self.copy_stream)
        ops.wait(compute, ready)
        self._ring_used = slot
        return self.staging[slot, 0, :, :n_i], self.staging[slot, 1, :, :n_i]

    def _release_ring(self, compute) -> None:
        """The compute work enqueued since the last staged page is that page's reader: mark its slot."""
        slot = self._ring_used
        if slot is not None:
            used = self.ops.new_event()
            self.ops.record(used, compute)
            self._slot_events[slot] = used
            self.pool.end_prefetch(slot)
            self._ring_used = None

    def _gpu_ptr(self, slot: int) -> int:
        return self.ops.ptr(self.gpu_store) + slot * self.page_bytes

    def _host_ptr(self, slot: int) -> int:
        e, j = divmod(slot, self.extent_pages)
        while len(self._extents) <= e:                                     # pinned on first use
            shape = (self.extent_pages, self.L, 2, self.h_kv, self.T, self.d)
            self._extents.append(allocate("pinned", self.extent_pages * self.page_bytes,
                                          lambda: self.ops.pinned_empty(shape, np.float16), "KV pages offloaded to host"))
        return self.ops.ptr(self._extents[e]) + j * self.page_bytes


