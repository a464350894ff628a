"""KV cache of the GPU-stage layers: a GPU page pool with eviction to pinned host RAM (thesis 4.2.2-4.2.3).

Same per-layer API as KVCacheCPU (the KVCache protocol, kv/interface.py), on device arrays (CuPy):
    kv.append(layer, k, v)  k, v [S, h_kv, d];  o = kv.attend(layer, q, scale)  q [S, h_a, d];  kv.advance(S)

Split by job, each a base of KVCacheGPU over the state this class holds:
  gpu_pages.GpuPageStore  page storage and staging: the device pool, the pinned host extents, the staging slots,
                          the copy stream, eviction (pages above the watermark, default 80% of the slots the VRAM
                          holds, copied device-to-host off the critical path).
  decode_gpu.GpuDecode    decode attention: page address tables, split plans, the paged decode kernels.
  prefill_gpu.GpuPrefill  prefill attention: tensor-core flash_prefill, else KeyBlocks; no S x S buffer.
  cuda_ops.CudaOps        the device ops all three call (buffers, streams, events, copies, kernels).
This class holds the sequence and its open step: begin_step / append / attend / advance, and the loan.
Loan: while the pool holds no page (a new request), lend_empty_pool hands its VRAM to the streamed prefill of the
CPU blocks (prefill_stream.py), which finishes before the first append. Invariant: the store holds at least
`loan_bytes` whenever its VRAM does, even beyond its whole slots: the plan counts the loan as the pool's floor.
Decode steps read the step's token count and window start from device memory (`_step_devs`, one per window,
written by begin_step), append with one kernel, and take their page address tables from begin_step: nothing a
layer enqueues depends on a host value that changes within a page table (and a window's first split), so the whole
step is captured once as a CUDA graph and replayed while graph_key() stays the same (runtime/decode_graph.DecodeGraph).
Attention sinks (`sinks=`, per layer, as KVCacheCPU takes them) live on the device once, one array per layer, and
every attention launch of a layer gets its array (the kernels' `sinks`; how each counts it: their modules).
The stream that is current when a method is called is the compute stream.
"""
from __future__ import annotations

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK

from helmc.runtime.kv.cuda_ops import D2D, D2H
from helmc.runtime.kv.decode_gpu import GpuDecode
from helmc.runtime.kv.gpu_pages import GpuPageStore
from helmc.runtime.kv.prefill_gpu import GpuPrefill
from helmc.runtime.kv.sinks import checked_sinks, sinks_of_layer


class KVCacheGPU(GpuPageStore, GpuDecode, GpuPrefill):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_tokens: int = KV_PAGE_TOKENS,
                 max_tokens: int = 4096, *, vram_bytes: int | None = None, gpu_pages: int | None = None,
                 watermark: float = KV_WATERMARK, offload: bool = True, staging_pages: int = 16,
                 host_extent_pages: int = 8, sliding_window: int | tuple[int, ...] | None = None,
                 score_budget_bytes: int = 32 << 20, prefill_block_tokens: int = 4096, loan_bytes: int = 0,
                 ops=None, sinks=None):
        if min(num_layers, num_kv_heads, head_dim, page_tokens, max_tokens, host_extent_pages) < 1:
            raise HelmcError("KVCacheGPU: expected positive layer, head, page and token counts")
        if not 0 < watermark <= 1:
            raise HelmcError(f"--kv-watermark expected in (0, 1], found {watermark}")
        if staging_pages < 2 or staging_pages % 2:
            raise HelmcError(f"KVCacheGPU: staging_pages expected an even number >= 2, found {staging_pages}")
        if ops is None:
            from helmc.runtime.kv.cuda_ops import CudaOps
            ops = CudaOps()
        self._init_store(ops, (num_layers, num_kv_heads, head_dim, page_tokens), max_tokens, vram_bytes=vram_bytes,
                         gpu_pages=gpu_pages, watermark=watermark, offload=offload, staging_pages=staging_pages,
                         host_extent_pages=host_extent_pages, loan_bytes=loan_bytes)
        # one window per layer (Gemma 3 interleaves sliding and global blocks; 0: the whole context)
        self.windows = tuple(sliding_window) if isinstance(sliding_window, (tuple, list)) else \
            (sliding_window or 0,) * num_layers
        if len(self.windows) != num_layers or any(not isinstance(w, (int, np.integer)) or w < 0 for w in self.windows):
            raise HelmcError(f"KVCacheGPU: sliding_window expected None, >= 0 or {num_layers} per-layer windows "
                             f"(0: none), found {sliding_window!r:.80}")
        self.score_budget_bytes, self.prefill_block_tokens = score_budget_bytes, prefill_block_tokens
        # Per layer, a logit per query head in the softmax's denominator (gpt-oss's attention sinks), or None: the
        # host vectors, and one device copy per layer made here, so a captured graph's launches keep their address
        self.sinks = checked_sinks(sinks, num_layers, num_kv_heads, "KVCacheGPU")
        self._sink_devs = None if self.sinks is None else tuple(ops.to_device(s) for s in self.sinks)
        self._seq = self.pool.add_sequence()
        self._pending = 0
        self._appended: set[int] = set()
        self._pending_kv: dict[int, object] = {}   # layer -> this prefill step's (K|V) rows [2, h_kv, S, d]
        self._rows: dict[int, tuple] = {}          # layer -> this decode step's (k, v), written by attend's launch
        self._plan_key = None
        self._ptr_tables: dict[int, object] = {}
        self._parts = None
        self._counters = ops.to_device(np.zeros(num_kv_heads, np.int32))   # paged_decode_fused's, 0 between launches
        # [n_tokens, t_begin] of a decode step, one per distinct window: each layer's kernels read their window's
        self._step_devs = {w: ops.device_empty((2,), np.int32) for w in sorted(set(self.windows))}
        self._step_dev = self._step_devs[self.windows[0]]
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
        self._drain_copies()
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
            for w, dev in self._step_devs.items():
                t_begin = max(0, n - w) if w else 0
                self.ops.write_step(dev, np.array([n, t_begin], np.int32), self.ops.current_stream())
            table = self._table()
            stage_of = self._split_plan(table)[4]
            for layer in range(self.L):
                self._page_ptrs(layer, table, stage_of)

    def step_for(self, layer: int):
        """The device [n_tokens, t_begin] that `layer`'s decode kernels read (its window's)."""
        return self._step_devs[self.windows[layer]]

    def graph_key(self):
        """In an open decode step: what a captured step baked in (page addresses, split plan, each window's first
        split: the launches take it from the host while t_begin comes from the device), or None when the step
        cannot replay a graph (a page on the host: its staging copies are chosen per step)."""
        if self._pending != 1:
            return None
        table = self._table()
        if not all(table.on_device(i) for i in range(table.n_pages)):
            return None
        plan = self._split_plan(table)
        firsts = tuple(self._one_launch(plan, w)[1] for w in sorted(self._step_devs))
        return (self.pool.version, table.n_pages, self._plan_key, firsts)

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
            if self._one_launch(split_plan, self.windows[layer])[0] and self.ops.has_fused_append(self.d):
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
        return self._prefill(layer, q, self._pending_kv.pop(layer), scale)

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

    # ------------------------------------------------------------------ the sequence's page table
    def _table(self):
        """The sequence's page table, rebuilt only when placement or length changed."""
        key = (self.pool.version, self.length, self._pending)
        if key != self._table_key:
            self._table_cache, self._table_key = self.pool.page_table(self._seq), key
        return self._table_cache

    def layer_sinks(self, layer: int, num_heads: int):
        """Layer `layer`'s sinks on the device ([num_heads] fp32, the kernels' `sinks`), or None without sinks."""
        return sinks_of_layer(self._sink_devs, layer, num_heads, "KVCacheGPU")

    def _check_layer(self, layer: int, what: str) -> None:
        if not 0 <= layer < self.L:
            raise HelmcError(f"KVCacheGPU.{what}: layer expected 0..{self.L - 1}, found {layer}")
