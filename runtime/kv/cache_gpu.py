"""KV cache of the GPU-stage layers: a GPU page pool with eviction to pinned host RAM (thesis 4.2.2-4.2.3).

Same per-layer API as KVCacheCPU, on device arrays (CuPy):
    kv.append(layer, k, v)  k, v [S, h_kv, d];  o = kv.attend(layer, q, scale)  q [S, h_a, d];  kv.advance(S)

Buffers (placement decided by kv_pages.PagePool):
  pool      [C, L, 2, h_kv, T, d] fp16 on the GPU; a slot holds one page for all L layers.
  host      pinned extents of `host_extent_pages` pages, same page layout, pinned on first use.
  staging   [staging_pages, 2, h_kv, T, d] fp16 on the GPU: one layer of a host page, for attention.
Eviction: advance() commits the step; pages above the watermark (default 80% of the slots the VRAM
holds) are copied device-to-host on a dedicated copy stream, off the critical path; their GPU slot
is freed when the copy's event has completed (polled at the next step, waited only when short).
Decode attention: one table of page addresses per layer; resident pages are read in place, host pages are copied
into staging half by half on the copy stream (events order copy -> kernel -> reuse). Up to SHORT_MAX_TOKENS of
pages one block per query head reads the whole window (paged_decode_short), else splits of whole pages (or page
parts); both fixed by the page count alone, so offload never changes the result.
Prefill attention (prefill_gpu.py, a base of this class): the tensor-core kernel where the bundle has it and
the keys are on the device, else KeyBlocks (paged_attention.attend_blocks, on CuPy) over the cached pages and
this step's new rows; no S x S buffer.
Loan: while the pool holds no page (a new request), lend_empty_pool hands its VRAM to the streamed prefill of the
CPU blocks (prefill_stream.py), which finishes before the first append. Invariant: the store holds at least
`loan_bytes` whenever its VRAM does, even beyond its whole slots: the plan counts the loan as the pool's floor.
Decode steps read the step's token count from device memory (`_step_dev`, written by begin_step), append with one
kernel, and take their page address tables from begin_step: nothing a layer enqueues depends on a host value that
changes within a page table, so the whole step is captured once as a CUDA graph and replayed while graph_key()
stays the same (runtime/gpu_session.DecodeGraph).
The stream that is current when a method is called is the compute stream.
"""
from __future__ import annotations

import contextlib

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK

from helmc.runtime.kv.pages import PagePool, PoolExhausted
from helmc.runtime.kv.cuda_ops import D2D, D2H, H2D
from helmc.runtime.kv.decode_splits import plan_splits, short_path, runs
from helmc.runtime.kv.prefill_gpu import GpuPrefill
from helmc.runtime.memory.allocation import allocate


class KVCacheGPU(GpuPrefill):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_tokens: int = KV_PAGE_TOKENS,
                 max_tokens: int = 4096, *, vram_bytes: int | None = None, gpu_pages: int | None = None,
                 watermark: float = KV_WATERMARK, offload: bool = True, staging_pages: int = 16,
                 host_extent_pages: int = 8, sliding_window: int | None = None,
                 score_budget_bytes: int = 32 << 20, prefill_block_tokens: int = 4096, loan_bytes: int = 0,
                 ops=None):
        if min(num_layers, num_kv_heads, head_dim, page_tokens, max_tokens, host_extent_pages) < 1:
            raise HelmcError("KVCacheGPU: expected positive layer, head, page and token counts")
        if not 0 < watermark <= 1:
            raise HelmcError(f"--kv-watermark expected in (0, 1], found {watermark}")
        if staging_pages < 2 or staging_pages % 2:
            raise HelmcError(f"KVCacheGPU: staging_pages expected an even number >= 2, found {staging_pages}")
        if ops is None:
            from helmc.runtime.kv.cuda_ops import CudaOps
            ops = CudaOps()
        self.ops, self.xp = ops, ops.xp
        self.L, self.h_kv, self.d, self.T = num_layers, num_kv_heads, head_dim, page_tokens
        self.max_tokens, self.offload = max_tokens, offload
        self.window = sliding_window or 0
        self.staging_pages, self.extent_pages = staging_pages, host_extent_pages
        self.score_budget_bytes, self.prefill_block_tokens = score_budget_bytes, prefill_block_tokens
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
        assert self._store.nbytes >= min(loan_bytes, room), (store_bytes, loan_bytes, room)
        self.staging = (ops.device_empty((staging_pages, 2, num_kv_heads, page_tokens, head_dim), np.float16)
                        if offload else None)
        self._extents: list = []
        self.copy_stream = ops.new_stream()
        self._evict_events: dict[int, object] = {}
        self._slot_events: list = [None] * staging_pages
        self._ring = 0
        self._seq = self.pool.add_sequence()
        self._pending = 0
        self._appended: set[int] = set()
        self._pending_kv: dict[int, object] = {}
        self._rows: dict[int, tuple] = {}          # layer -> this decode step's (k, v), written by attend's launch
        self._plan_key = None
        self._ptr_tables: dict[int, object] = {}
        self._parts = None
        self._counters = ops.to_device(np.zeros(num_kv_heads, np.int32))   # paged_decode_fused's, 0 between launches
        self._ring_used: int | None = None
        self._step_dev = ops.device_empty((2,), np.int32)                 # [n_tokens, t_begin] of a decode step
        self._table_key = None
        self._table_cache = None
        self.num_sms = getattr(ops, "num_sms", 132)

    # ------------------------------------------------------------------ sizes and state
    @staticmethod
    def workspace_bytes(num_heads: int, num_kv_heads: int, head_dim: int, page_tokens: int = KV_PAGE_TOKENS,
                        staging_pages: int = 16, score_budget_bytes: int = 32 << 20, max_splits: int = 128,
                        caches: int = 1) -> int:
        """VRAM `caches` caches use beyond their page pools: each one's staging and split partials (held for
        the cache's life), and prefill's score tile with its exp and mask temporaries (about three tiles at
        once), counted once: they are taken from the allocator's pool for one prefill's attention and given
        back, and the caches of a batch prefill one sequence at a time on one stream."""
        staging = staging_pages * 2 * num_kv_heads * page_tokens * head_dim * 2
        partials = max_splits * num_heads * (head_dim + 2) * 4
        return caches * (staging + partials) + 3 * score_budget_bytes

    @property
    def length(self) -> int:
        return self.pool.length(self._seq)

    @property
    def gpu_pages(self) -> int:
        return self.pool.gpu_capacity

    @property
    def resident_limit(self) -> int:
        return self.pool.watermark_pages

    def reset(self) -> None:
        """Forget the sequence (a new request); waits for copies still in flight."""
        self.ops.synchronize_stream(self.copy_stream)
        for slot in self.pool.staged():
            self.pool.end_prefetch(slot)
        self._ring_used = None
        for pid in self.pool.in_flight():
            self.pool.complete_eviction(pid)
        self._evict_events.clear()
        self.pool.free_sequence(self._seq)
        self._seq = self.pool.add_sequence()
        self._pending = 0
        self._appended.clear()
        self._pending_kv.clear()

    def lend_empty_pool(self, nbytes: int):
        """The page pool's VRAM as a flat uint8 buffer of `nbytes`, or None when the pool is smaller or
        holds pages. The streamed prefill of a new request's CPU blocks runs before any GPU block
        writes KV, so its staging and prompt buffers live there instead of VRAM of their own (the plan
        counts them as the pool's floor). The loan ends at the next append, which every caller reaches
        only after its last kernel on the loan is enqueued on the same stream."""
        if self.length or self._pending or self.pool.gpu_free != self.pool.gpu_capacity:
            return None
        flat = self._store.view(np.uint8)                                  # [bytes/2] fp16 -> [bytes]
        if nbytes > flat.size:
            return None
        self.ops.synchronize_stream(self.copy_stream)                      # no eviction copy still reads it
        return flat[:nbytes]

    # ------------------------------------------------------------------ one step
    def begin_step(self, S: int) -> None:
        """Reserve the pages of this step's S rows (the first append does it if the caller did not). A
        decode step (S = 1) also writes [n_tokens, t_begin] to the device for the kernels and uploads every
        layer's page address table, so the layers' work needs no host value (graph_key)."""
        if self._pending:
            raise HelmcError(f"KVCacheGPU.begin_step: a step of {self._pending} rows is open; advance() it first")
        if S < 1:
            raise HelmcError("KVCacheGPU.append: expected at least one row, found 0")
        if self.length + S > self.max_tokens:
            raise HelmcError(f"KV cache (GPU layers): {self.length + S} tokens needed, room for {self.max_tokens}")
        self._complete_evictions(block=False)
        self._make_room(self.pool.gpu_slots_needed(self._seq, S))
        self.pool.reserve(self._seq, S)
        self._pending = S
        if S == 1:
            n = self.length + 1
            t_begin = max(0, n - self.window) if self.window else 0
            self.ops.write_step(self._step_dev, np.array([n, t_begin], np.int32), self.ops.current_stream())
            table = self._table()
            stage_of = self._split_plan(table)[4]
            for layer in range(self.L):
                self._page_ptrs(layer, table, stage_of)

    def graph_key(self):
        """In an open decode step: what a captured step baked in (page addresses, split plan), or None when
        the step cannot replay a graph (a page on the host: its staging copies are chosen per step; a
        sliding window: its first split moves)."""
        if self._pending != 1 or self.window:
            return None
        table = self._table()
        if not all(table.on_device(i) for i in range(table.n_pages)):
            return None
        return (self.pool.version, table.n_pages, self._plan_key)

    def forget_appends(self, layers: range | None = None) -> None:
        """The appends of the open step to `layers` (default all) were never run (a failed capture): keep its
        reservation, redo them."""
        layers = range(self.L) if layers is None else layers
        self._appended.difference_update(layers)
        for layer in layers:
            self._pending_kv.pop(layer, None)
            self._rows.pop(layer, None)

    def mark_replayed(self, layers: range | None = None) -> None:
        """A replayed graph appended the row of this decode step of `layers` (default every layer; hybrid decode:
        the resident blocks', after the streamed blocks appended theirs eagerly). Invariant: every layer of the
        step is appended once, so after this the step's layers are exactly the graph's and those before it."""
        layers = set(range(self.L) if layers is None else layers)
        assert self._pending == 1 and not (self._appended & layers), \
            "mark_replayed: expected an open decode step, the graph's layers untouched"
        assert layers <= set(range(self.L)), (sorted(layers), self.L)
        self._appended |= layers

    def append(self, layer: int, k, v) -> None:
        """Write this step's K, V rows [S, h_kv, d] of `layer` into their pages (GPU slot, or straight to
        a host page for the older pages of a long prompt)."""
        xp = self.xp
        self._check_layer(layer, "append")
        S = k.shape[0]
        if self._pending == 0:
            self.begin_step(S)
        elif S != self._pending or layer in self._appended:
            raise HelmcError(f"KVCacheGPU.append: layer {layer} expected {self._pending} new rows once per step, "
                             f"found {S}{' (second append)' if layer in self._appended else ''}")
        if S == 1:   # decode: the new row's page is on the GPU (reserve puts the newest pages there)
            table = self._table()
            split_plan = self._split_plan(table)
            ptrs = self._page_ptrs(layer, table, split_plan[4])
            k16 = xp.ascontiguousarray(k.reshape(self.h_kv, self.d), dtype=np.float16)   # [1, h_kv*d] -> [h_kv, d]
            v16 = xp.ascontiguousarray(v.reshape(self.h_kv, self.d), dtype=np.float16)
            if self._one_launch(split_plan)[0] and self.ops.has_fused_append(self.d):
                self._rows[layer] = (k16, v16)      # attend's one launch writes the row (paged_decode_fused_append)
            else:
                self.ops.decode_append(k16, v16, ptrs, self.T, self.h_kv, self.d, self._step_dev)
            self._appended.add(layer)
            return
        kv = xp.empty((2, self.h_kv, S, self.d), np.float16)                              # one copy per side
        kv[0] = k.reshape(S, self.h_kv, self.d).transpose(1, 0, 2)                        # [S,h_kv,d] -> [h_kv,S,d]
        kv[1] = v.reshape(S, self.h_kv, self.d).transpose(1, 0, 2)
        T, start = self.T, self.length
        table = self._table()
        compute = self.ops.current_stream()
        for i in range(start // T, table.n_pages):
            a, b = max(start, i * T), min(start + S, (i + 1) * T)
            if a >= b:
                continue
            off, r0, n = a - i * T, a - start, b - a
            # rows (K|V, head) of the page's layer slice [2, h_kv, T, d]: 2*h_kv strided copies in one call (a
            # device page's too: CuPy's 5-index slice assignment cost ~0.1 ms of host time per layer)
            dst, kind = ((self._gpu_ptr(table.gpu_slots[i]), D2D) if table.on_device(i) else
                         (self._host_ptr(table.host_slots[i]), D2H))     # a page the placement sent to the host
            self.ops.memcpy2d(dst + (layer * self.slice_elems + off * self.d) * 2, T * self.d * 2,
                              self.ops.ptr(kv) + r0 * self.d * 2, S * self.d * 2, n * self.d * 2, 2 * self.h_kv,
                              kind, compute)
        if S > 1:
            self._pending_kv[layer] = kv
        self._appended.add(layer)

    def attend(self, layer: int, q, scale: float, out=None):
        """Causal attention of this step's S query rows [S, h_a, d] over every cached token of `layer`;
        returns [S, h_a, d] in q's dtype. A decode step writes into `out` (fp16, h_a*d elements) if given."""
        self._check_layer(layer, "attend")
        if layer not in self._appended:
            raise HelmcError(f"KVCacheGPU.attend: layer {layer} has not appended this step's rows")
        S = q.shape[0]
        if S != self._pending:
            raise HelmcError(f"KVCacheGPU.attend: expected {self._pending} query rows, found {S}")
        q = q.reshape(S, -1, self.d)                                      # [S, h_a*d] -> [S, h_a, d]
        if S == 1:
            return self._decode(layer, q, scale, out)
        return self._prefill(layer, q, scale)

    def advance(self, S: int) -> None:
        """Commit the step, then start the evictions the watermark asks for (copy stream, async)."""
        if S != self._pending or len(self._appended) != self.L:
            missing = sorted(set(range(self.L)) - self._appended)
            raise HelmcError(f"KVCacheGPU.advance: expected {self._pending} rows appended by every layer, "
                             f"found advance({S}) with layers {missing} missing")
        # Invariant: a decode row left to the attention's launch was written by it (every append is attended).
        assert not self._rows, f"KVCacheGPU.advance: layers {sorted(self._rows)} appended a row never attended"
        started = self.pool.advance(self._seq, S)
        if started:
            self._copy_out(started)
        self._pending = 0
        self._appended.clear()
        self._pending_kv.clear()

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

    # ------------------------------------------------------------------ decode
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
        one_launch, first = self._one_launch(split_plan)
        pm, ps, po = self._partials(n_splits, h_a)
        q16 = xp.ascontiguousarray(q[0], dtype=np.float16)               # [1, h_a, d] -> [h_a, d]
        res = xp.empty((h_a, self.d), np.float16) if out is None else out.reshape(h_a, self.d)   # [h_a*d] -> [h_a, d]
        row = self._rows.pop(layer, None)
        short = self._short(table, h_a)
        if short and not one_launch:         # some pages on the host: all of them staged in one chunk, then one launch
            _, _, _, chunks, _ = split_plan
            assert len(chunks) == 1 and row is None, "KVCacheGPU._decode: short-path host pages fit one chunk"
            with self._staged(layer, table, chunks[0][1], stage_of, self._after_host_writes()):
                ops.decode_short(q16, ptrs, self.T, self._step_dev, self.h_kv, self.d, scale, res)
        elif short:                          # a row append left to this launch (one_launch held there) goes in it
            ops.decode_short(q16, ptrs, self.T, self._step_dev, self.h_kv, self.d, scale, res) if row is None else \
                ops.decode_short_append(q16, *row, ptrs, self.T, self._step_dev, self.h_kv, self.d, scale, res)
        elif row is not None:
            assert one_launch, "KVCacheGPU._decode: a deferred row needs the one-launch path"
            ops.decode_fused_append(q16, row[0], row[1], ptrs, self.T, self._step_dev, span, first, n_splits - first,
                                    self.h_kv, self.d, scale, pm, ps, po, self._counters, res)
        elif one_launch and ops.has_fused_decode(self.d, h_a // self.h_kv):   # one launch for all splits
            ops.decode_fused(q16, ptrs, self.T, self._step_dev, span, first, n_splits - first, self.h_kv, self.d,
                             scale, pm, ps, po, self._counters, res)
        else:
            self._decode_in_parts(layer, table, q16, ptrs, scale, first, res)
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

    def _one_launch(self, split_plan) -> tuple[bool, int]:
        """(whether one launch covers this decode step's splits -- none of them on host pages --, the first split
        the window keeps)."""
        span, _, host_split, _, _ = split_plan
        n = self.length + 1
        first = (max(0, n - self.window) // span) if self.window else 0
        return not any(host_split[first:]), first

    def _decode_in_parts(self, layer: int, table, q16, ptrs, scale: float, first: int, res) -> None:
        """_decode's splits [first, n_splits) as partials -- the resident runs at once, the host pages' splits as
        their pages arrive in the staging slots -- then their merge into res [h_a, d]."""
        ops, h_a = self.ops, q16.shape[0]
        span, n_splits, host_split, chunks, stage_of = self._split_plan(table)
        pm, ps, po = self._parts

        def launch(s0, s1):
            ops.decode_partial(q16, ptrs, self.T, self._step_dev, span, s0, s1 - s0, self.h_kv, self.d, scale, pm, ps, po)

        for s0, s1 in runs(sp for sp in range(first, n_splits) if not host_split[sp]):   # resident: no waiting
            launch(s0, s1)
        todo = [(splits, pages) for splits, pages in chunks if splits[-1] >= first]
        compute = self._after_host_writes() if todo else None
        for splits, pages in todo:
            with self._staged(layer, table, pages, stage_of, compute):
                for s0, s1 in runs(sp for sp in splits if sp >= first):
                    launch(s0, s1)
        ops.decode_merge(pm, ps, po, first, n_splits, h_a, self.d, h_a // self.h_kv, res)

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

    # ------------------------------------------------------------------ addresses
    def _table(self):
        """The sequence's page table, rebuilt only when placement or length changed."""
        key = (self.pool.version, self.length, self._pending)
        if key != self._table_key:
            self._table_cache, self._table_key = self.pool.page_table(self._seq), key
        return self._table_cache

    def _check_layer(self, layer: int, what: str) -> None:
        if not 0 <= layer < self.L:
            raise HelmcError(f"KVCacheGPU.{what}: layer expected 0..{self.L - 1}, found {layer}")

    def _gpu_ptr(self, slot: int) -> int:
        return self.ops.ptr(self.gpu_store) + slot * self.page_bytes

    def _host_ptr(self, slot: int) -> int:
        e, j = divmod(slot, self.extent_pages)
        while len(self._extents) <= e:                                     # pinned on first use
            shape = (self.extent_pages, self.L, 2, self.h_kv, self.T, self.d)
            self._extents.append(allocate("pinned", self.extent_pages * self.page_bytes,
                                          lambda: self.ops.pinned_empty(shape, np.float16), "KV pages offloaded to host"))
        return self.ops.ptr(self._extents[e]) + j * self.page_bytes

