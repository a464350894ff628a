"""The model side of batched serving: a Session's stages with one KV cache per batch slot.

Each slot has its own cache object per stage (KVCacheCPU for the CPU blocks, KVCacheGPU for the GPU
blocks), made like the session's own, so a cache never holds two sequences and the caches' internals stay
as they are. A step runs the compiled position-wise block functions once on the rows of every sequence in it
(Stage.forward_batch: each weight read once per step for all of them) and attention per sequence on its own
slot's cache; the head runs on the last row of each sequence. With a plan whose prefill streams the CPU blocks
to the GPU (plan.placement.prefill_on_gpu), new requests' prompts go that way, together: each CPU block's weights cross
PCIe once for all of them, into a loan of VRAM kept beside the slots' pages (the plan counts both). A hybrid
decode plan (runtime/hybrid/) serving several sequences runs its schedule's batched twin (runtime/hybrid/batch.py):
each streamed group's weights cross PCIe once per step for all of them.

    m = BatchModel(session, max_batch=4)
    logits = m.prefill(slot=2, ids=[...])          # [V]
    logits = m.prefill_many([(1, ids1), (3, ids3)])  # [[V], [V]]: the prompts' rows together in each step
    logits = m.decode([0, 2], [tok0, tok2])        # [2, V]
    m.free(2)                                      # the slot's pages back to its pool, at once
"""
from __future__ import annotations

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.stage import batch_phase, decode_batch_sizes, decode_step_rows


class BatchModel:
    def __init__(self, session, max_batch: int, kv_watermark: float = 0.8):
        pl, mem, wl = session.plan.placement, session.plan.memory, session.plan.workload
        if max_batch < 1:
            raise HelmcError(f"--max-batch expected >= 1, found {max_batch}")
        if max_batch > wl.batch:
            raise HelmcError(f"--max-batch {max_batch}: the bundle's plan was made for at most {wl.batch} "
                             f"sequences at once (build it with `helmc build ... --max-batch {max_batch}`)")
        self.session, self.spec, self.max_batch = session, session.spec, max_batch
        self.max_context = mem.max_context
        # A hybrid decode plan (runtime/hybrid/) serving one sequence runs the session's own step (its captured
        # decode graph); several go through the batched twin of its schedule (runtime/hybrid/batch.py) on the slot
        # caches below: the CPU stage holds the CPU groups' blocks, the GPU cache the streamed and resident ones.
        self.hybrid = pl.is_hybrid and max_batch == 1
        self.loan_in_ring = False
        if self.hybrid:
            self.cpu_caches = self.gpu_caches = None
            self.page_tokens, self.chunk, self.streamed = session.gpu.stage.kv.T, 0, None
            session.reset()
            return
        if pl.is_hybrid:
            # The one-sequence step's references to the session's GPU cache go, so its VRAM is freed for the slots'.
            backend = session.gpu.hybrid.backend
            backend.gpu_kv = None
            for st in backend.stages:
                st.kv = None
        stage = session.cpu_stage
        self.cpu_caches = [stage.kv] + [_cpu_cache_like(stage) for _ in range(max_batch - 1)] if stage else None
        gstage = getattr(session.gpu, "stage", None)
        # The streamed prefill (plan.placement.prefill_on_gpu: the CPU blocks' weights cross PCIe once per prompt and the GPU
        # runs it) moves here, onto the slots' caches: newcomers' prompts stream together (prefill_many). It
        # borrowed the session's empty page pool; with several slots the pool is rarely empty, so the loan the
        # plan counted beside the pages (cost_model.memory_needs, batch > 1) becomes VRAM of its own.
        self.streamed = session.gpu.streamed_prefill if session.gpu is not None else None
        if session.gpu is not None:
            session.gpu.streamed_prefill = None
        loan = self.streamed.buffer_bytes([wl.prompt_len] * wl.batch) if self.streamed else 0
        ring_lends = self.streamed is not None and session.gpu.loan_in_ring    # decided by load_gpu_parts
        if self.streamed is not None and not ring_lends:
            self.streamed.lend = None     # its lender was the session's cache, which goes (its VRAM with it)
        # No GPU stage (only the head there): the plan counted the loan as workspace, allocated per prefill.
        # A hybrid ring that holds the loan keeps lending it (gpu_session.load_gpu_parts): nothing beside the pages.
        self.loan_in_ring = ring_lends
        self._lend, self._loan_bytes = ((self.streamed.lend, session.gpu.hybrid.backend.ring.nbytes) if ring_lends
                                        else (None, loan))
        self.gpu_caches = None
        if gstage is not None:
            self.gpu_caches, lend, loan_bytes = _gpu_caches(gstage, max_batch, kv_watermark, 0 if ring_lends else loan)
            if not ring_lends:
                self._lend, self._loan_bytes = lend, loan_bytes
            if self.streamed is not None and self._lend is None:
                self.streamed = None      # no VRAM for the loan beside the pages: prompts run on the CPU stage
        self.page_tokens = (stage.kv.page_tokens if stage else gstage.kv.T)
        # The GPU stage takes a prompt this many rows at a time (the plan counted one chunk of activations).
        self.chunk = pl.prefill_chunk_tokens or (512 if session.gpu is not None else 0)
        for slot in range(max_batch):          # slot 0 is the session's own cache: it may hold an earlier request
            self.free(slot)

    # ------------------------------------------------------------------ state
    def length(self, slot: int) -> int:
        if self.hybrid:
            return self.session.position
        caches = self.cpu_caches or self.gpu_caches
        return caches[slot].length

    def pages_in_use(self) -> int:
        """KV pages the slot caches hold (0 when every request has finished)."""
        n = 0
        if self.hybrid:
            groups = ([self.session.cpu_stage.kv], [self.session.gpu.stage.kv])
        else:
            groups = (self.cpu_caches or [], self.gpu_caches or [])
        for caches in groups:
            for kv in caches:
                for pool in getattr(kv, "pools", (kv.pool,)):      # a CPU cache: a pool per layer kind
                    n += pool.host_capacity - pool.host_free + pool.gpu_capacity - pool.gpu_free
        return n

    def free(self, slot: int) -> None:
        if self.hybrid:
            self.session.reset()
            return
        for caches in (self.cpu_caches, self.gpu_caches):
            if caches is not None:
                caches[slot].reset()

    # ------------------------------------------------------------------ steps
    def prefill(self, slot: int, ids: list[int]) -> np.ndarray:
        """The prompt of a new request into its (empty) slot; the last row's logits [V]."""
        if self.length(slot):
            raise HelmcError(f"prefill: slot {slot} expected empty, holds {self.length(slot)} tokens")
        if self.hybrid:
            return self.session.forward(list(ids))[-1]          # the streamed prefill, as Session.generate's
        if self.streamed is not None and len(ids) > 1:
            return self._prefill_streamed([(slot, ids)])[0]
        step = self.chunk or len(ids)
        for c0 in range(0, len(ids), step):     # one KV step per chunk: activations bounded by the chunk
            logits = self._step([slot], [ids[c0:c0 + step]])
        return logits[0]

    def prefill_many(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """The prompts of several new requests, (slot, ids) each, into their (empty) slots; each one's last row's
        logits [V], bit-identical to prefill(slot, ids) alone.

        Why: one request's prefill after another made the last of 8 wait for all 7 before it (TTFT
        20.6 s on the GPU machine), and each prompt's CPU GEMMs read and convert every weight for its 128 rows
        only. Here each prompt is cut into the chunks prefill() would run, and the chunks of different prompts
        share a step up to `chunk` rows (CPU-only: 512, or the longest prompt): the CPU stage runs them as one
        block call per layer (its prefill kernels form every row the same whatever the row count, attention
        runs per sequence). What would not be bit-identical to the single prefill runs apart: the GPU stage
        (cuBLAS picks its algorithm by the row count) goes sequence by sequence, the head takes the last rows
        through the batched decode variant (each row as the one-row decode head), and the one-token chunks,
        which prefill() runs as a decode step, run together as one batched decode step, after the others."""
        if self.hybrid or len(items) == 1:
            return [self.prefill(slot, ids) for slot, ids in items]
        for slot, _ in items:
            if self.length(slot):
                raise HelmcError(f"prefill: slot {slot} expected empty, holds {self.length(slot)} tokens")
        if self.streamed is not None:
            return self._prefill_many_streamed(items)
        cap = self.chunk or max([512] + [len(ids) for _, ids in items])
        step = self.chunk or cap
        pieces = [(i, slot, ids[c0:c0 + step], c0 + step >= len(ids))                  # (item, slot, rows, last)
                  for i, (slot, ids) in enumerate(items) for c0 in range(0, len(ids), step)]
        out: list = [None] * len(items)

        def run(group):
            rows = self._decode_rows if all(len(p[2]) == 1 for p in group) else self._prefill_rows
            for (i, _, _, last), row in zip(group, rows([p[1] for p in group], [p[2] for p in group])):
                if last:
                    out[i] = row
        group: list = []
        for p in [p for p in pieces if len(p[2]) > 1] + [p for p in pieces if len(p[2]) == 1]:   # 1-row chunks end
            if group and (sum(len(g[2]) for g in group) + len(p[2]) > cap or any(g[1] == p[1] for g in group)
                          or (len(p[2]) == 1) != (len(group[0][2]) == 1)):
                run(group)
                group = []
            group.append(p)
        run(group)
        return out

    def _prefill_many_streamed(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """prefill_many through the streamed prefill: the prompts of more than one token in groups whose buffers
        fit the loan (each group streams the CPU blocks' weights once), one-token prompts as one batched decode
        step, as prefill() runs them alone."""
        out: list = [None] * len(items)
        for g in loan_groups([len(ids) for _, ids in items], self.streamed.buffer_bytes, self._loan_bytes):
            for i, row in zip(g, self._prefill_streamed([items[i] for i in g])):
                out[i] = row
        ones = [i for i, (_, ids) in enumerate(items) if len(ids) == 1]
        if ones:
            rows = self._decode_rows([items[i][0] for i in ones], [items[i][1] for i in ones])
            for i, row in zip(ones, rows):
                out[i] = row
        return out

    def _prefill_streamed(self, items: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """Prompts (slot, ids), each of more than one token, into their empty slots: the CPU blocks through the
        streamed prefill (StreamedPrefill.run_sequences: each block's weights cross once for all of them, each
        prompt's rows as it alone would form them), then the GPU stage and head per sequence
        (GpuParts.finish_prefill). Each prompt's logits [V] are bit-identical whatever else is in the group."""
        inputs = [self._inputs([slot], [ids]) for slot, ids in items]             # (x [S, H], cos, sin [S, D])
        slots = [slot for slot, _ in items]
        gpu = self.session.gpu
        from helmc.runtime.cuda_runtime import tvm_stream
        with gpu.stream, tvm_stream(gpu.stream):
            xs = self.streamed.run_sequences(inputs, [self.cpu_caches[s] for s in slots], self._lend)
            return gpu.finish_prefill(xs, [c for _, c, _ in inputs], [s for _, _, s in inputs],
                                      [self.gpu_caches[s] for s in slots] if self.gpu_caches else None,
                                      self.streamed.take_gpu_rows())    # hybrid: the streamed blocks' K, V

    def _decode_rows(self, slots: list[int], ids: list[list[int]]) -> np.ndarray:
        return self.decode(slots, [r[0] for r in ids]) if len(slots) > 1 else self._step(slots, ids)

    def _prefill_rows(self, slots: list[int], ids: list[list[int]]) -> np.ndarray:
        """Logits [B, V] of each sequence's last row after its ids[b] (one or more rows each): see prefill_many."""
        if len(slots) == 1:
            return self._step(slots, ids)
        rows = [len(r) for r in ids]
        x, cos, sin = self._inputs(slots, ids)
        cpu = [self.cpu_caches[s] for s in slots] if self.cpu_caches else None
        if self.session.gpu is not None:
            gpu = [self.gpu_caches[s] for s in slots] if self.gpu_caches else None
            return self.session.gpu.prefill_batch(x, cos, sin, self.session.cpu_stage, cpu, gpu, rows)
        import tvm.runtime
        dev = tvm.cpu()
        xt = self.session.cpu_stage.forward_batch(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(cos, dev),
                                                  tvm.runtime.tensor(sin, dev), cpu, rows)
        last = xt.numpy()[np.cumsum(rows) - 1]                                       # [S, H] -> [B, H]
        padded = decode_step_rows([1] * len(rows), decode_batch_sizes(self.session.plan.workload.batch))
        last = np.concatenate([last, np.zeros((padded - len(rows), last.shape[1]), last.dtype)])  # [B', H]
        return self.session.head(tvm.runtime.tensor(last, dev), batch_phase(padded), True)[:len(rows)]

    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One new token for each slot's sequence, all in one step; logits [len(slots), V]."""
        if self.hybrid:
            return self.session.forward([tokens[0]])              # the plan's groups (runtime/hybrid/), [1, V]
        return self._step(slots, [[t] for t in tokens])

    def _inputs(self, slots: list[int], ids: list[list[int]]):
        """x [S, H], cos / sin [S, D] of the rows: sequence b's ids[b] at its own next positions."""
        rows = [len(r) for r in ids]
        for s, n in zip(slots, rows):
            if self.length(s) + n > self.max_context:
                raise HelmcError(f"context: {self.length(s) + n} tokens needed, the plan allows {self.max_context}")
        positions = np.concatenate([np.arange(self.length(s), self.length(s) + n) for s, n in zip(slots, rows)])
        cos, sin = self.session.rope.cos_sin(positions)                          # [S, D] each, per row's position
        x = self.session.embed(np.asarray([t for r in ids for t in r], dtype=np.int64))   # [S, H]
        return x, cos, sin

    def _step(self, slots: list[int], ids: list[list[int]]) -> np.ndarray:
        rows = [len(r) for r in ids]
        x, cos, sin = self._inputs(slots, ids)
        # A batched decode step runs the compiled variant for the next batch size up, on zero rows past the
        # sequences' (Stage.forward_batch gives them no attention and no KV; their logits are dropped here).
        padded = decode_step_rows(rows, decode_batch_sizes(self.session.plan.workload.batch))
        if padded > len(x):
            pad = padded - len(x)
            x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])         # [B, H] -> [padded, H]
            cos = np.concatenate([cos, np.zeros((pad, cos.shape[1]), cos.dtype)])  # [B, D] -> [padded, D]
            sin = np.concatenate([sin, np.zeros((pad, sin.shape[1]), sin.dtype)])  # [B, D] -> [padded, D]
        last = np.cumsum(rows) - 1                                               # each sequence's last row
        cpu = [self.cpu_caches[s] for s in slots] if self.cpu_caches else None
        if self.session.gpu is not None:
            gpu = [self.gpu_caches[s] for s in slots] if self.gpu_caches else None
            return self.session.gpu.forward_batch(x, cos, sin, self.session.cpu_stage, cpu, gpu, rows)
        import tvm.runtime
        dev = tvm.cpu()
        xt = self.session.cpu_stage.forward_batch(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(cos, dev),
                                                  tvm.runtime.tensor(sin, dev), cpu, rows)
        if len(rows) > 1 and all(n == 1 for n in rows):                         # a batched decode step
            return self.session.head(xt, batch_phase(padded), True)[:len(slots)]  # [padded, V] -> [B, V]
        if len(slots) == 1:
            return self.session.head(xt, "prefill" if rows[0] > 1 else "decode", False)
        xs = xt.numpy()[last] if xt.shape[0] != len(slots) else xt                # [S, H] -> [B, H]
        if not isinstance(xs, tvm.runtime.Tensor):
            xs = tvm.runtime.tensor(np.ascontiguousarray(xs), dev)
        return self.session.head(xs, "prefill", True)


def loan_groups(lengths: list[int], buffer_bytes, loan: int) -> list[list[int]]:
    """The prompts (by index, lengths[i] tokens) that stream together: in order, each group as long as its
    buffer_bytes(lengths) fits the loan; a prompt whose buffers alone do not fit goes alone (its run allocates
    its own). One-token prompts are left out (they run as a decode step)."""
    groups: list[list[int]] = []
    for i, n in enumerate(lengths):
        if n == 1:
            continue
        if groups and buffer_bytes([lengths[j] for j in groups[-1]] + [n]) <= loan:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _cpu_cache_like(stage):
    """A KVCacheCPU made as cpu_stage.build_cpu_stage makes the stage's own (the arena commits memory only
    as pages are written)."""
    from helmc.runtime.kv.cache_cpu import KVCacheCPU, find_decode_kernel
    kv, spec = stage.kv, stage.spec
    return KVCacheCPU(num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                      page_tokens=kv.page_tokens, max_tokens=kv.max_tokens, dtype=kv.kv_dtype,
                      sliding_window=kv.windows, threads=kv.threads, sinks=kv.sinks,
                      attend_kernel=find_decode_kernel(stage.vm.module, spec.num_heads, spec.num_kv_heads,
                                                       spec.head_dim, spec.dtype) if kv.uses_kernel else None)


def _gpu_caches(stage, max_batch: int, watermark: float, loan: int = 0):
    """(max_batch KVCacheGPUs, lend, the loan's bytes): the caches share the VRAM budget of the stage's own page pool, each a
    1/max_batch share of what the streamed prefill's loan leaves (the session's cache is dropped first so its
    pool's memory goes back to CuPy's allocator for theirs); lend(nbytes) hands out the loan's buffer (None
    when it is smaller, or when no loan is asked or the pages would not fit beside it). One slot: the
    session's own cache, whose empty pool is lent as Session.generate's prefill borrows it."""
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    kv = stage.kv
    if max_batch == 1:
        return [kv], (kv.lend_empty_pool if loan else None), (kv._store.nbytes if loan else 0)
    vram, ops = kv.vram_budget, kv.ops      # the store never exceeds it
    args = dict(num_layers=kv.L, num_kv_heads=kv.h_kv, head_dim=kv.d, page_tokens=kv.T, max_tokens=kv.max_tokens,
                watermark=watermark, offload=kv.offload, sliding_window=kv.windows, ops=ops, sinks=kv.sinks)
    pages_each = (vram - loan) // max_batch // kv.page_bytes if loan else 0
    if loan and pages_each < (2 if kv.offload else -(-kv.max_tokens // kv.T)):
        loan = 0                 # the pages first: no room for the loan beside them
    stage.kv = None
    del kv
    buf = ops.device_empty((loan,), np.uint8) if loan else None
    caches = [KVCacheGPU(vram_bytes=(vram - loan) // max_batch, **args) for _ in range(max_batch)]
    stage.kv = caches[0]
    lend = (lambda nbytes: buf[:nbytes] if nbytes <= buf.size else None) if buf is not None else None
    return caches, lend, loan
