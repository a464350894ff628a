"""KV cache of the CPU-stage layers: host pages, attended on the CPU (thesis 4.2.2).

The KV of blocks that run on the CPU never crosses PCIe. It lives in host pages managed by the same
bookkeeping as the GPU cache (kv_pages.PagePool, host tier only), and attention walks those pages
with the online-softmax update of Algorithm 3 (paged_attention.py).

Per step, the stage calls for every layer `append(layer, k, v)` then `attend(layer, q, scale)`,
and once at the end `advance(S)`:

    kv = KVCacheCPU(num_layers=18, num_kv_heads=8, head_dim=128, page_tokens=512, max_tokens=40960)
    for layer in range(18):
        kv.append(layer, k, v)             # k, v [S, h_kv, d]: rows for positions length..length+S-1
        o = kv.attend(layer, q, scale)     # q [S, h_a, d] -> o [S, h_a, d], causal over 0..length+S-1
    kv.advance(S)

A batched decode step (one token for each of several sequences, a cache each) goes through DecodeBatch instead,
which does the same per cache with the per-call work done once a step.

Layers are grouped by attention window (runtime/kv/layer_kinds.py): each kind (the global layers, those of one
sliding window) has a page table and an arena of its own, and a sliding kind releases its pages as they leave
the window, so its memory stays about window + one page however long the sequence.

Storage: per kind one arena [L_kind, 2, h_kv, slots * T, d] in the model's dtype (float16; bfloat16 as uint16 bits,
appended with round-to-nearest-even; float32 models keep float32); page slot p holds tokens
[p*T, (p+1)*T) of every head, so a run of consecutive slots is one strided view and one batched matmul
per head group (pages of one sequence are handed out in order, so a sequence is usually a single run).
The arena comes from np.empty (64-byte aligned, as TVM requires of zero-copy tensors): the OS commits
it as pages are first written, not at construction.

Decode (S == 1) over a single run goes to the bundle's compiled kernel when one is given
(`attend_kernel`, found with find_decode_kernel; schedules/cpu/decode_attention.py): it reads each K/V
byte once, in the arena's dtype, on TVM's thread pool. Otherwise, and for prefill, NumPy attends
blocks widened to float32 one at a time (NumPy's fp16 matmul is far slower than widening first).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.kv.options import KV_PAGE_TOKENS

from helmc.runtime.kv.layer_kinds import KindPages
from helmc.runtime.memory.allocation import aligned_empty, allocate
from helmc.runtime.kv.paged_attention import (KeyBlock, attend_blocks, group_queries, merge_partials, partial_attention,
                              ungroup_output)
from helmc.runtime.kv.sinks import checked_sinks, sinks_of_layer

KV_DTYPES = ("float32", "float16", "bfloat16")
_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}


def decode_attention_name(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> str:
    """Global symbol of the compiled decode-attention kernel in cpu_stage.so (the compiler names it so)."""
    short = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[kv_dtype]
    return f"helmc_decode_attention_{short}_h{num_q_heads}_kv{num_kv_heads}_d{head_dim}"


def find_decode_kernel(module, num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str):
    """The compiled decode-attention kernel for this layer shape and KV dtype in a loaded module (a VM's
    `.module`, or the executable), or None: bundles built before the kernel existed, float32 models."""
    if kv_dtype not in _STORAGE:
        return None
    try:
        return module.get_function(decode_attention_name(num_q_heads, num_kv_heads, head_dim, kv_dtype),
                                   query_imports=True)
    except AttributeError:
        return None


def kv_dtype_name(dtype) -> str:
    """"float32" | "float16" | "bfloat16" from a NumPy dtype or a name."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in KV_DTYPES:
        raise HelmcError(f"KVCacheCPU: dtype expected one of {KV_DTYPES}, found {name}")
    return name


class KVCacheCPU:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_tokens: int = KV_PAGE_TOKENS,
                 max_tokens: int = 4096, dtype=np.float32, sliding_window: int | tuple[int, ...] | None = None,
                 threads: int = 1, block_tokens: int = 8192, score_budget_bytes: int = 64 << 20,
                 attend_kernel=None, sinks=None):
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                          ("page_tokens", page_tokens), ("max_tokens", max_tokens), ("threads", threads),
                          ("block_tokens", block_tokens)):
            if not isinstance(val, (int, np.integer)) or val < 1:
                raise HelmcError(f"KVCacheCPU: {name} expected a positive integer, found {val!r}")
        self.kv_dtype = kv_dtype_name(dtype)
        self.dtype = _STORAGE[self.kv_dtype]                              # storage: uint16 holds bf16 bits
        # One window for every layer, or one per layer (0: that layer attends to the whole context; Gemma 3).
        windows = tuple(sliding_window) if isinstance(sliding_window, (tuple, list)) else \
            (sliding_window or 0,) * num_layers
        if (sliding_window is not None and not isinstance(sliding_window, (tuple, list)) and sliding_window < 1) \
                or len(windows) != num_layers or any(not isinstance(w, (int, np.integer)) or w < 0 for w in windows):
            raise HelmcError(f"KVCacheCPU: sliding_window expected None, >= 1 or {num_layers} per-layer windows "
                             f"(0: none), found {sliding_window!r:.80}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_tokens, self.max_tokens = page_tokens, max_tokens
        self.windows = windows
        # Per layer, a logit per query head in the softmax's denominator (gpt-oss's attention sinks), or None. The
        # compiled decode kernel has no sinks: a cache with them attends in NumPy.
        self.sinks = checked_sinks(sinks, num_layers, num_kv_heads, "KVCacheCPU")
        self.threads = threads
        self.block_tokens = max(page_tokens, block_tokens // page_tokens * page_tokens)
        self.score_budget_bytes = score_budget_bytes
        n_slots = -(-max_tokens // page_tokens)
        self._kinds: list[KindPages] = []
        self._kind_of: list[tuple[KindPages, int]] = [None] * num_layers     # layer -> (its kind, index in the kind)
        for w in sorted(set(windows)):
            layers = tuple(i for i in range(num_layers) if windows[i] == w)
            shape = (len(layers), 2, num_kv_heads, n_slots * page_tokens, head_dim)
            arena = allocate("kv", int(np.prod(shape)) * np.dtype(self.dtype).itemsize,
                             lambda shape=shape: aligned_empty(shape, self.dtype),
                             f"{max_tokens} tokens x {len(layers)} CPU layers")
            kind = KindPages(w, layers, page_tokens, n_slots, arena)
            self._kinds.append(kind)
            for j, i in enumerate(layers):
                self._kind_of[i] = (kind, j)
        self._pending = 0
        self._appended: set[int] = set()
        self._executor = None
        self._kernel = attend_kernel if self.sinks is None else None
        self._kernel_args = None          # per layer (k, v) TVM tensors over the arena, made on first use
        self._rows: dict[int, tuple] = {}  # this decode step's (arena row, kernel row0, n) per kind: DecodeBatch

    # ------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Committed tokens (those of finished steps)."""
        return self._kinds[0].length

    @property
    def pool(self):
        """The page pool of the first layer kind (the global layers where there are any)."""
        return self._kinds[0].pool

    @property
    def pools(self) -> tuple:
        """Every layer kind's page pool (what the cache holds: pages in use are theirs together)."""
        return tuple(kind.pool for kind in self._kinds)

    @property
    def arenas(self) -> tuple:
        """Every layer kind's arena [L_kind, 2, h_kv, slots * T, d], global layers first."""
        return tuple(kind.arena for kind in self._kinds)

    def kind_pages(self, layer: int) -> KindPages:
        """The page table and arena `layer` shares with the layers of its window."""
        return self._kind_of[layer][0]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype=np.float32) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * _STORAGE[kv_dtype_name(dtype)].itemsize

    @property
    def uses_kernel(self) -> bool:
        return self._kernel is not None

    def reset(self) -> None:
        for kind in self._kinds:
            kind.reset()
        self._pending = 0
        self._appended.clear()
        self._rows = {}

    def prefault(self, tokens: int) -> int:
        """Write zeros over the arena rows of positions 0..tokens-1 of an empty cache (the pool hands its page slots
        out lowest first, so a sequence's first positions land there), committing their memory now rather than in
        the steps that first write them (the arena is np.empty: the OS commits a page on its first write, ~3 ms a
        fresh 2 MiB on the VMs helmc is measured on); a sliding kind's rows only as many as its window holds
        (its slots are handed out again). Bytes written; the cache stays empty."""
        if self.length or self._pending:
            raise HelmcError(f"KVCacheCPU.prefault: expected an empty cache, found {self.length} tokens")
        written = 0
        for kind in self._kinds:
            limit = min(max(0, int(tokens)), kind.live_pages_bound() * self.page_tokens, kind.arena.shape[3])
            rows = kind.arena[:, :, :, :limit]                                # [L_kind, 2, h_kv, rows, d]
            rows[...] = 0
            written += rows.nbytes
        return written

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ one step
    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write this step's K, V rows [S, h_kv, d] (or [S, h_kv*d]) of `layer` at positions length.."""
        self._check_layer(layer, "append")
        S = k.shape[0]
        k = np.asarray(k).reshape(S, self.num_kv_heads, self.head_dim)    # [S, h_kv*d] -> [S, h_kv, d]
        v = np.asarray(v).reshape(S, self.num_kv_heads, self.head_dim)    # [S, h_kv*d] -> [S, h_kv, d]
        if S < 1:
            raise HelmcError("KVCacheCPU.append: expected at least one row, found 0")
        if self._pending == 0:
            if self.length + S > self.max_tokens:
                raise HelmcError(f"KV cache (CPU layers): {self.length + S} tokens needed, room for {self.max_tokens}")
            self._reserve(S)
        elif S != self._pending or layer in self._appended:
            raise HelmcError(f"KVCacheCPU.append: layer {layer} expected {self._pending} new rows once per step, "
                             f"found {S} rows{' (second append)' if layer in self._appended else ''}")
        T, start = self.page_tokens, self.length
        kind, j = self._kind_of[layer]
        table = kind.table(self._pending)
        for i in range(start // T, table.first_page + table.n_pages):
            a, b = max(start, i * T), min(start + S, (i + 1) * T)
            if a >= b:
                continue
            base = table.host_slots[i - table.first_page] * T - i * T      # arena row of position p is base + p
            rows, src = slice(base + a, base + b), slice(a - start, b - start)
            self._store(kind.arena[j, 0, :, rows], k[src].transpose(1, 0, 2))   # [n, h_kv, d] -> [h_kv, n, d]
            self._store(kind.arena[j, 1, :, rows], v[src].transpose(1, 0, 2))   # [n, h_kv, d] -> [h_kv, n, d]
        self._appended.add(layer)

    def attend(self, layer: int, q: np.ndarray, scale: float) -> np.ndarray:
        """Causal attention of this step's S query rows over every cached token of `layer`.
        q [S, h_a, d] (or [S, h_a*d]); returns [S, h_a, d] in q's dtype."""
        self._check_layer(layer, "attend")
        if layer not in self._appended:
            raise HelmcError(f"KVCacheCPU.attend: layer {layer} has not appended this step's rows")
        S = q.shape[0]
        if S != self._pending:
            raise HelmcError(f"KVCacheCPU.attend: expected {self._pending} query rows, found {S}")
        q = np.asarray(q).reshape(S, -1, self.head_dim)                   # [S, h_a*d] -> [S, h_a, d]
        if q.shape[1] % self.num_kv_heads:
            raise HelmcError(f"KVCacheCPU.attend: query heads ({q.shape[1]}) must be a multiple of "
                             f"KV heads ({self.num_kv_heads})")
        n = self.length + S
        if S == 1:
            if self._kernel is not None:
                runs = self.kind_pages(layer).slot_runs(n, self._pending)
                if len(runs) == 1:
                    return self._decode_kernel(layer, q, runs[0][1] - runs[0][0], n, scale)
            return self._decode(q, self._blocks(layer, n, widen=False), n, scale, self.windows[layer],
                                sinks_of_layer(self.sinks, layer, q.shape[1], "KVCacheCPU"))
        return attend_blocks(np, q, self.length, self._blocks(layer, n), self.num_kv_heads, scale, self.windows[layer],
                             np.float32, self.score_budget_bytes, sinks=sinks_of_layer(self.sinks, layer, q.shape[1], "KVCacheCPU"))

    def advance(self, S: int) -> None:
        if S != self._pending or len(self._appended) != self.num_layers:
            missing = sorted(set(range(self.num_layers)) - self._appended)
            raise HelmcError(f"KVCacheCPU.advance: expected {self._pending} rows appended by every layer, "
                             f"found advance({S}) with layers {missing} missing")
        for kind in self._kinds:
            kind.advance(S)
        self._pending = 0
        self._appended.clear()
        self._rows = {}

    def _reserve(self, S: int) -> None:
        for kind in self._kinds:
            kind.reserve(S)
        self._pending = S
        self._rows = {}

    def _decode_row(self, layer: int) -> tuple[int, int | None, int]:
        """This one-token step's (arena row of the new token, arena row of position 0 or None, tokens n) in
        `layer`'s kind's arena: the step's reservation made on first use, and what append/attend work out per call,
        worked out once a step and kind. The row of position 0 (where it would be: a sliding kind's first pages
        are released) is None where the compiled kernel cannot attend (no kernel, or pages in several runs); a
        layer's kernel reads from position window_start(layer, n) on."""
        if self._pending == 0:
            if self.length + 1 > self.max_tokens:
                raise HelmcError(f"KV cache (CPU layers): {self.length + 1} tokens needed, room for {self.max_tokens}")
            self._reserve(1)
        elif self._pending != 1:
            raise HelmcError(f"KVCacheCPU: a one-token decode step in a step of {self._pending} rows")
        kind = self._kind_of[layer][0]
        out = self._rows.get(kind.window)
        if out is None:
            p = self.length
            row, n = kind.row_of(p, 1), p + 1
            runs = kind.slot_runs(n, 1) if self._kernel is not None else ()
            out = self._rows[kind.window] = (row, runs[0][1] - runs[0][0], n) if len(runs) == 1 else (row, None, n)
        return out

    def _write_row(self, layer: int, row: int, k: np.ndarray, v: np.ndarray) -> None:
        """K and V [h_kv, d] of one position, already in the arena's dtype, at arena row `row` of `layer`."""
        kind, j = self._kind_of[layer]
        kind.arena[j, 0, :, row] = k
        kind.arena[j, 1, :, row] = v

    def window_start(self, layer: int, n: int) -> int:
        """The first of positions 0..n-1 that `layer`'s newest query sees (its sliding window's)."""
        w = self.windows[layer]
        return max(0, n - w) if w else 0

    def _to_storage(self, x: np.ndarray) -> np.ndarray:
        """Float rows in the arena's dtype, rounded as _store's assignment rounds them."""
        return bf16_bits(x) if self.kv_dtype == "bfloat16" else x.astype(self.dtype, copy=False)

    # ------------------------------------------------------------------ internals
    def _check_layer(self, layer: int, what: str) -> None:
        if not 0 <= layer < self.num_layers:
            raise HelmcError(f"KVCacheCPU.{what}: layer expected 0..{self.num_layers - 1}, found {layer}")

    def _store(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Write float rows into the arena in its dtype (bf16: round to nearest even, as torch does)."""
        if self.kv_dtype == "bfloat16":
            dst[...] = bf16_bits(src)
        else:
            dst[...] = src

    def _widen(self, x: np.ndarray) -> np.ndarray:
        """float32 copy of arena rows (float32 arena: the view itself)."""
        if self.kv_dtype == "bfloat16":
            return (x.astype(np.uint32) << 16).view(np.float32)
        return x.astype(np.float32, copy=False)

    def _widened(self, b: KeyBlock) -> KeyBlock:
        return KeyBlock(b.pos0, b.n, (lambda b=b: tuple(self._widen(x) for x in b.load())))

    def _blocks(self, layer: int, n: int, widen: bool = True) -> list[KeyBlock]:
        """Key blocks of `layer` over positions 0..n-1 (those inside the step's first query's window); `widen`:
        load() gives float32, else the arena's own dtype."""
        kind, j = self._kind_of[layer]
        K, V = kind.arena[j, 0], kind.arena[j, 1]                          # [h_kv, slots*T, d] each
        lo = self.window_start(layer, self.length + 1)      # the step's first query's window: it sees the most
        out = []
        for pos0, row0, tok in kind.slot_runs(n, self._pending):
            for a in range(0, tok, self.block_tokens):
                b = min(tok, a + self.block_tokens)
                if pos0 + b <= lo:
                    continue
                r = row0 + a
                out.append(KeyBlock(pos0 + a, b - a, (lambda r=r, c=b - a: (K[:, r:r + c], V[:, r:r + c]))))
        return [self._widened(b) for b in out] if widen and self.kv_dtype != "float32" else out

    def _decode_kernel(self, layer: int, q: np.ndarray, row0: int, n: int, scale: float) -> np.ndarray:
        """One query row over positions lo..n-1, stored at arena rows row0+lo.. of the layer's kind, on the
        compiled kernel."""
        if self._kernel_args is None:
            self._bind_kernel(q.shape[1])
        lo = self.window_start(layer, n)
        k, v = self._kernel_args[layer]
        np.copyto(self._q, q[0])
        self._kernel(self._q_tensor, k, v, row0 + lo, n - lo, float(scale), self._o_tensor)
        out = aligned_empty((1, self._o.shape[0], self.head_dim), q.dtype)  # aligned: the stage's tensor is a view
        np.copyto(out, self._o.reshape(out.shape))                           # [h_a, d] -> [1, h_a, d]
        return out

    def _bind_kernel(self, num_q_heads: int) -> None:
        """Zero-copy TVM tensors over every layer's K and V arena and over the q/o staging buffers."""
        from tvm.runtime import from_dlpack
        self._q = aligned_empty((num_q_heads, self.head_dim), np.float32)
        self._o = aligned_empty((num_q_heads, self.head_dim), np.float32)
        self._q_tensor, self._o_tensor = from_dlpack(self._q), from_dlpack(self._o)
        self._kernel_args = [(from_dlpack(kind.arena[j, 0]), from_dlpack(kind.arena[j, 1]))
                             for kind, j in self._kind_of]

    def _decode(self, q: np.ndarray, blocks: list[KeyBlock], n: int, scale: float, window: int,
                sinks=None) -> np.ndarray:
        """NumPy decode over blocks in the arena's dtype, each widened to float32 per worker's share (the first
        worker's state starts from the sinks, if any)."""
        qt = group_queries(np, q, self.num_kv_heads)                      # [1, h_a, d] -> [h_kv, g, d]
        q_pos0 = n - 1 if window else None
        groups = _split_by_tokens(blocks, self.threads)
        if self.kv_dtype != "float32":
            groups = [[self._widened(b) for b in group] for group in groups]
        if len(groups) == 1:
            parts = [partial_attention(np, qt, q_pos0, 1, groups[0], scale, window, sinks=sinks)]
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kv-cpu")
            parts = list(self._executor.map(
                lambda i: partial_attention(np, qt, q_pos0, 1, groups[i], scale, window,
                                            sinks=sinks if i == 0 else None), range(len(groups))))
        o = merge_partials(np, parts) if len(parts) > 1 else parts[0].o / parts[0].s[..., None]   # [h_kv, g, d]
        return ungroup_output(o, 1).astype(q.dtype, copy=False)           # [h_kv, g, d] -> [1, h_a, d]


class DecodeBatch:
    """Attention of a batched decode step: one new token for each of several sequences, each on its own KVCacheCPU
    with the compiled kernel (Stage.forward_batch, a slot cache per sequence).

    Per block, append + attend per sequence then a concatenate cost more than the attention at serving contexts
    (16-core Xeon, Qwen3-8B, ~190 tokens: 53 us per (block, sequence)): each call checked its arguments, looked
    its page table up, wrote K and V through transposed views, copied q into the kernel's staging buffer and the
    output out of it, and the step concatenated the rows and copied them into a new TVM tensor. Here the work per
    (block, sequence) is two row writes into the arena and the kernel call, on tensors made once: q is staged for
    all rows in one copy (row b a zero-copy tensor over it), the kernel writes row b of one output buffer, and
    that buffer is the tensor handed to post_attn. The arena row and the kernel's row0 / n come from the cache
    once a step (KVCacheCPU._decode_row). Same kernel, same inputs, same bits as the per-sequence path.
    """

    def __init__(self, num_q_heads: int, head_dim: int):
        self.h_a, self.d = num_q_heads, head_dim
        self._bufs: dict[int, tuple] = {}      # rows S -> (q staging [S, h_a, d], out [S, h_a*d], tensors)

    @staticmethod
    def applies(caches: list, q_dim: int) -> bool:
        """All caches attend decode on the compiled kernel, and a row of q/o starts 64-byte aligned (TVM's
        zero-copy tensors need it)."""
        return (q_dim * 4) % 64 == 0 and all(isinstance(kv, KVCacheCPU) and kv.uses_kernel for kv in caches)

    def _buffers(self, S: int) -> tuple:
        if S not in self._bufs:
            from tvm.runtime import from_dlpack
            q = aligned_empty((S, self.h_a, self.d), np.float32)
            o = aligned_empty((S, self.h_a * self.d), np.float32)
            o[...] = 0
            self._bufs[S] = (q, o, [from_dlpack(q[b]) for b in range(S)],
                             [from_dlpack(o[b].reshape(self.h_a, self.d)) for b in range(S)], from_dlpack(o))
        return self._bufs[S]

    def attend(self, caches: list, layer: int, q, k, v, scale: float):
        """q [S, h_a*d], k, v [S, h_kv*d] float32 (TVM CPU tensors or arrays), row b < len(caches) caches[b]'s
        new token, the rest padding: appends each row's K, V to its cache and returns [S, h_a*d] attention
        outputs (padding rows zero) as a TVM tensor over this object's buffer, which the next call overwrites."""
        B, S = len(caches), q.shape[0]
        qs, out, q_t, o_t, out_t = self._buffers(S)
        first = caches[0]
        q, k, v = np.from_dlpack(q), np.from_dlpack(k), np.from_dlpack(v)      # zero-copy views
        if q.dtype != np.float32:
            raise HelmcError(f"DecodeBatch: float32 queries expected, found {q.dtype}")
        np.copyto(qs, q.reshape(S, self.h_a, self.d))
        if B < S:
            out[B:] = 0                                    # padding rows attend nothing
        shape = (B, first.num_kv_heads, first.head_dim)  # the sequences' rows, not the padding's
        ks = first._to_storage(k[:B].reshape(shape))      # [B, h_kv*d] -> [B, h_kv, d], arena dtype
        vs = first._to_storage(v[:B].reshape(shape))
        scale = float(scale)
        for b, kv in enumerate(caches):
            if layer in kv._appended or not 0 <= layer < kv.num_layers:
                raise HelmcError(f"KVCacheCPU.append: layer {layer} appended twice in a step, or out of range")
            row, row0, n = kv._decode_row(layer)
            kv._write_row(layer, row, ks[b], vs[b])
            kv._appended.add(layer)
            if row0 is None:                               # pages in several runs: the cache's own path
                out[b] = kv.attend(layer, q[b:b + 1], scale).reshape(-1)
                continue
            if kv._kernel_args is None:
                kv._bind_kernel(self.h_a)
            kt, vt = kv._kernel_args[layer]
            lo = kv.window_start(layer, n)
            kv._kernel(q_t[b], kt, vt, row0 + lo, n - lo, scale, o_t[b])
        return out_t


def _split_by_tokens(blocks: list[KeyBlock], parts: int, min_tokens: int = 2048) -> list[list[KeyBlock]]:
    """Cut the block list into up to `parts` groups of about equal tokens, splitting big blocks so
    each worker gets a share; a context shorter than parts * min_tokens stays in one group."""
    total = sum(b.n for b in blocks)
    parts = max(1, min(parts, total // min_tokens))
    if parts == 1:
        return [blocks]
    share = -(-total // parts)
    pieces: list[KeyBlock] = []
    for b in blocks:
        for a in range(0, b.n, share):
            c = min(share, b.n - a)
            pieces.append(KeyBlock(b.pos0 + a, c, (lambda b=b, a=a, c=c: tuple(x[:, a:a + c] for x in b.load()))))
    groups: list[list[KeyBlock]] = [[]]
    filled = 0
    for p in pieces:
        if filled >= share and len(groups) < parts:
            groups.append([])
            filled = 0
        groups[-1].append(p)
        filled += p.n
    return groups


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits (uint16), NaN kept NaN (tvm_tensors.bf16_bits_from_float32
    without the TVM import, so the cache stays importable on its own)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    out = ((bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out



def default_threads() -> int:
    """Threads for decode attention over long contexts: the cores this process may use, at most 16."""
    try:
        return max(1, min(16, len(os.sched_getaffinity(0))))
    except AttributeError:
        return max(1, min(16, os.cpu_count() or 1))
