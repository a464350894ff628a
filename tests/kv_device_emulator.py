"""A NumPy stand-in for CudaOps (runtime/kv/cuda_ops.py) so KVCacheGPU runs on the CPU in tests.

Buffers are NumPy arrays at real addresses, copies are ctypes.memmove, and the two decode kernels
are re-implemented from their documented contract (split = pages [i*p, (i+1)*p), unnormalised
(m, s, o) per split, merge over a split range). What this checks on a machine without a GPU:
every address KVCacheGPU computes (pool slots, layer slices, pinned extents, staging slots,
2-D copy pitches) and every placement decision. Guards:
  - new device and pinned buffers are filled with NaN, so reading a page that was never written
    poisons the output;
  - a host->device copy must read inside a pinned buffer and write inside a device buffer, a
    device->host copy must write inside a pinned buffer, and the kernel may only read device
    buffers (never pinned host memory);
  - attention sinks (`sinks`, a layer's [h_a] logits, or None) enter as each kernel's module says: the merge adds
    them once (decode_merge and the fused kernels), the single-launch kernels (short, prefill_causal) start from
    them, flash_prefill starts from them in a launch that reads no state;
  - with delay_events=True an event is done only after synchronize(), so eviction completions are
    exercised on the slow path;
  - a race detector: streams carry vector clocks (events copy them, waits and host syncs merge
    them), and every access to a device or pinned buffer (copies, kernel page reads, NumPy reads
    and writes of device buffers, which stand for compute-stream kernels) is checked against the
    last conflicting access from another stream. A missing wait_event fails the test even though
    the emulator itself runs everything in issue order.
"""
from __future__ import annotations

import ctypes

import numpy as np

H2D, D2H, D2D = 1, 2, 3


CELL = 64          # race-detector granularity in bytes, relative to each buffer's start


class RaceError(AssertionError):
    pass


class _Stream:
    def __init__(self, name, sid):
        self.name, self.sid = name, sid
        self.clock: dict[int, int] = {sid: 0}


class _Event:
    def __init__(self):
        self.recorded = False
        self.done = False
        self.clock: dict[int, int] = {}


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, -1) < v:
            into[k] = v


class TrackedArray(np.ndarray):
    """A device buffer (or a view of one): NumPy reads and writes count as compute-stream accesses."""
    ops = None

    def __getitem__(self, key):
        out = super().__getitem__(key)
        if self.ops is not None and isinstance(out, np.ndarray):
            self.ops.access(self.ops.current_stream(), out, write=False)
        return out

    def __setitem__(self, key, value):
        if self.ops is not None:
            self.ops.access(self.ops.current_stream(), np.ndarray.__getitem__(self, key), write=True)
        super().__setitem__(key, value)


class EmulatedOps:
    xp = np

    def __init__(self, num_sms: int = 4, delay_events: bool = False, flash: bool = True, fused: bool = True,
                 fused_append: bool | None = None, fused_append_batch: bool | None = None, short: bool | None = None):
        self.num_sms = num_sms
        self.flash, self.flash_launches = flash, 0       # whether the "cubin" has flash_prefill (sm_80+, new bundles)
        self.fused, self.fused_launches = fused, 0       # whether it has paged_decode_fused (newer bundles)
        self.fused_append = fused if fused_append is None else fused_append   # paged_decode_fused_append (s16)
        self.fused_append_launches = 0
        # paged_decode_fused_append_batch (s19)
        self.fused_append_batch = self.fused_append if fused_append_batch is None else fused_append_batch
        self.batch_launches = 0
        # paged_decode_short* (s21): bundles with the batched kernel have them unless a test says otherwise
        self.short = self.fused_append_batch if short is None else short
        self.short_launches = 0
        self.delay_events = delay_events
        self._host = _Stream("host", 0)
        self._streams = 1
        self._compute = self.new_stream("compute")
        self._buffers: list[tuple[int, int, str, np.ndarray]] = []   # (start, end, "device"|"pinned", keepalive)
        self._cells: dict[tuple[int, int], list] = {}                 # cell -> [last write (sid, t), {sid: t} reads]
        self.copies = {H2D: 0, D2H: 0, D2D: 0}
        self.h2d_bytes = 0
        self.kernel_launches = 0

    # buffers
    def _register(self, a: np.ndarray, kind: str) -> np.ndarray:
        a.fill(np.nan if a.dtype.kind == "f" else -1)   # poison: a read before a write shows
        self._buffers.append((a.ctypes.data, a.ctypes.data + a.nbytes, kind, a))
        return a

    def device_empty(self, shape, dtype):
        a = self._register(np.empty(shape, dtype), "device").view(TrackedArray)
        a.ops = self
        return a

    def pinned_empty(self, shape, dtype):
        return self._register(np.empty(shape, dtype), "pinned")

    def ptr(self, a) -> int:
        return a.ctypes.data

    def to_device(self, a):
        return np.array(a, copy=True)

    # race detector
    def _tick(self, stream) -> int:
        _merge(stream.clock, self._host.clock)          # work the host issues after a sync follows it
        stream.clock[stream.sid] += 1
        return stream.clock[stream.sid]

    def _touch(self, stream, lo: int, hi: int, write: bool) -> None:
        base = next((b0 for b0, b1, _, _ in self._buffers if b0 <= lo < b1), None)
        if base is None:
            return                                          # a temporary of the compute stream
        t = self._tick(stream)
        for cell in range((lo - base) // CELL, (hi - 1 - base) // CELL + 1):
            last_w, reads = self._cells.setdefault((base, cell), [None, {}])
            prior = [last_w] if last_w else []
            if write:
                prior += list(reads.items())
            for sid, ts in prior:
                if sid != stream.sid and stream.clock.get(sid, -1) < ts:
                    raise RaceError(f"{'write' if write else 'read'} on stream {stream.name} of buffer "
                                    f"offset {cell * CELL} races with an access of stream {sid} (no wait_event)")
            if write:
                self._cells[(base, cell)] = [(stream.sid, t), {}]
            else:
                reads[stream.sid] = t

    def access(self, stream, a: np.ndarray, write: bool) -> None:
        """Record an access to the bytes a view spans (conservatively, first to last element)."""
        if a.size == 0:
            return
        lo = hi = a.ctypes.data
        for n, st in zip(a.shape, a.strides):
            lo += min(0, (n - 1) * st)
            hi += max(0, (n - 1) * st)
        self._touch(stream, lo, hi + a.itemsize, write)

    def kind_of(self, start: int, nbytes: int) -> str | None:
        for b0, b1, kind, _ in self._buffers:
            if b0 <= start < b1:
                assert start + nbytes <= b1, f"range [{start}, +{nbytes}) runs past the end of a {kind} buffer"
                return kind
        return None

    # streams and events
    def current_stream(self):
        return self._compute

    def new_stream(self, name="copy"):
        self._streams += 1
        return _Stream(name, self._streams)

    def new_event(self):
        return _Event()

    def record(self, event, stream):
        _merge(stream.clock, self._host.clock)
        event.recorded = True
        event.done = not self.delay_events
        event.clock = dict(stream.clock)

    def wait(self, stream, event):
        assert event.recorded, "waiting on an event that was never recorded"
        _merge(stream.clock, event.clock)

    def query(self, event):
        assert event.recorded
        if event.done:
            _merge(self._host.clock, event.clock)
        return event.done

    def synchronize(self, event):
        event.done = True
        _merge(self._host.clock, event.clock)

    def synchronize_stream(self, stream):
        _merge(self._host.clock, stream.clock)

    # copies
    def _check(self, dst, src, nbytes, kind, stream):
        self._touch(stream, src, src + nbytes, write=False)
        self._touch(stream, dst, dst + nbytes, write=True)
        if kind == H2D:
            assert self.kind_of(src, nbytes) == "pinned", "H2D copy must read pinned host memory"
            assert self.kind_of(dst, nbytes) == "device", "H2D copy must write a device buffer"
            self.h2d_bytes += nbytes
        elif kind == D2H:
            assert self.kind_of(dst, nbytes) == "pinned", "D2H copy must write pinned host memory"
            assert self.kind_of(src, nbytes) != "pinned", "D2H copy must read device memory"
        self.copies[kind] += 1

    def memcpy(self, dst, src, nbytes, kind, stream):
        self._check(dst, src, nbytes, kind, stream)
        ctypes.memmove(dst, src, nbytes)

    def memcpy2d(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert width <= dpitch and width <= spitch, "2-D copy wider than its pitch"
        for r in range(height):
            self._check(dst + r * dpitch, src + r * spitch, width, kind, stream)
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    # kernels
    def _page(self, addr: int, shape) -> np.ndarray:
        nbytes = int(np.prod(shape)) * 2
        assert self.kind_of(addr, nbytes) == "device", "the decode kernel may only read device memory"
        self._touch(self._compute, addr, addr + nbytes, write=False)
        buf = (ctypes.c_char * nbytes).from_address(addr)
        return np.frombuffer(buf, dtype=np.float16).reshape(shape)

    def write_step(self, step, values, stream):
        self.write(step, np.asarray(values, np.int32), stream)

    def write(self, dst, values, stream):
        assert values.dtype == dst.dtype and values.nbytes == dst.nbytes, (values.dtype, dst.dtype)
        self.access(stream, dst, write=True)
        np.ndarray.__setitem__(dst, Ellipsis, values.reshape(dst.shape))

    def _step(self, step) -> tuple[int, int]:
        self.access(self._compute, step, write=False)
        return int(np.ndarray.__getitem__(step, 0)), int(np.ndarray.__getitem__(step, 1))

    def decode_append(self, k, v, page_ptrs, page_tokens, num_kv_heads, head_dim, step):
        self.kernel_launches += 1
        pos = self._step(step)[0] - 1
        page, row = divmod(pos, page_tokens)
        addr = int(page_ptrs[page])
        nbytes = 2 * num_kv_heads * page_tokens * head_dim * 2
        assert self.kind_of(addr, nbytes) == "device", "the append kernel may only write device memory"
        self._touch(self._compute, addr, addr + nbytes, write=True)
        sl = np.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=np.float16).reshape(
            2, num_kv_heads, page_tokens, head_dim)                       # [bytes] -> [2, h_kv, T, d]
        sl[0, :, row] = np.asarray(k).reshape(num_kv_heads, head_dim)
        sl[1, :, row] = np.asarray(v).reshape(num_kv_heads, head_dim)

    def prefill_causal(self, q, kv, num_kv_heads, head_dim, window, scale, out, sinks=None):
        """The kernel's contract: causal (windowed) softmax attention of S fresh rows over their own K/V, the sinks
        in each row's denominator."""
        self.kernel_launches += 1
        for a, w in ((q, False), (kv, False), (out, True)):
            self.access(self._compute, a, write=w)
        S, h_a, d = q.shape
        g = h_a // num_kv_heads
        k = np.repeat(np.asarray(kv[0], np.float64), g, axis=0)            # [h_kv, S, d] -> [h_a, S, d]
        v = np.repeat(np.asarray(kv[1], np.float64), g, axis=0)
        e = np.einsum("shd,htd->hst", np.asarray(q, np.float64), k) * scale   # [h_a, S, S]
        t = np.arange(S)
        visible = (t[None, :] <= t[:, None]) & ((t[None, :] > t[:, None] - window) if window else True)
        e = np.where(visible[None], e, -np.inf)
        m = e.max(-1, keepdims=True)
        sink = None if sinks is None else np.asarray(sinks, np.float64)[:, None, None]   # [h_a] -> [h_a, 1, 1]
        if sink is not None:
            m = np.maximum(m, sink)
        p = np.exp(e - m)
        den = p.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - m))
        o = np.einsum("hst,htd->shd", p / den, v)
        np.ndarray.__setitem__(out, Ellipsis, o.astype(np.float16))

    def has_flash(self, head_dim, group):
        return self.flash

    def flash_prefill(self, q, k, v, n_k, q_pos0, num_kv_heads, window, scale, out, page_ptrs=None,
                      page_tokens=0, paged_keys=0, k_pos0=0, state=None, state_in=False, state_out=False, sinks=None):
        """The kernel's contract: causal (windowed) softmax attention of n_q rows at positions q_pos0.. over
        keys 0..n_k-1: those before paged_keys in device pages (page_ptrs, multiples of 64), the rest at rows
        0.. of k, v [h_kv, >= n_k - paged_keys, d] (rows contiguous, one head stride)."""
        self.kernel_launches += 1
        self.flash_launches += 1
        for a, w in ((q, False), (k, False), (v, False), (out, True)):
            self.access(self._compute, a, write=w)
        n_q, h_a, d = q.shape
        assert k.shape[1] >= n_k - paged_keys and k.strides[1:] == (2 * d, 2) and v.strides == k.strides
        assert paged_keys % 64 == 0 and (not paged_keys or page_tokens % 64 == 0), (paged_keys, page_tokens)
        ks, vs = [np.asarray(k[:, :n_k - paged_keys])], [np.asarray(v[:, :n_k - paged_keys])]
        if paged_keys:
            self.access(self._compute, page_ptrs, write=False)
            n_pages = -(-paged_keys // page_tokens)
            pages = [self._page(int(np.ndarray.__getitem__(page_ptrs, i)), (2, num_kv_heads, page_tokens, d))
                     for i in range(n_pages)]
            ks.insert(0, np.concatenate([p[0] for p in pages], axis=1)[:, :paged_keys])
            vs.insert(0, np.concatenate([p[1] for p in pages], axis=1)[:, :paged_keys])
        g = h_a // num_kv_heads
        kk = np.repeat(np.concatenate(ks, axis=1).astype(np.float64), g, axis=0)   # [h_kv, n_k, d] -> [h_a, n_k, d]
        vv = np.repeat(np.concatenate(vs, axis=1).astype(np.float64), g, axis=0)
        e = np.einsum("shd,htd->hst", np.asarray(q, np.float64), kk) * scale   # [h_a, n_q, n_k]
        p, t = q_pos0 + np.arange(n_q)[:, None], k_pos0 + np.arange(n_k)[None, :]
        visible = (t <= p) & ((t > p - window) if window else True)
        e = np.where(visible[None], e, -np.inf)
        # the kernel's softmax state per (head, row): running max m, sum l, unnormalised o; carried in `state`
        m_prev, l_prev, o_prev = np.full((h_a, n_q), -np.inf), np.zeros((h_a, n_q)), np.zeros((h_a, n_q, d))
        if sinks is not None and not state_in:           # a launch reading no state starts from the sinks
            m_prev = np.repeat(np.asarray(sinks, np.float64)[:, None], n_q, axis=1)   # [h_a] -> [h_a, n_q]
            l_prev = np.ones((h_a, n_q))
        if state_in:
            self.access(self._compute, state, write=False)
            st = np.asarray(state, np.float64).transpose(1, 0, 2)              # [n_q, h_a, d+2] -> [h_a, n_q, d+2]
            o_prev, m_prev, l_prev = st[..., :d], st[..., d], st[..., d + 1]
        m = np.maximum(m_prev, e.max(-1) if n_k else -np.inf)
        safe = np.where(np.isneginf(m), 0.0, m)
        alpha = np.where(np.isneginf(m_prev), 0.0, np.exp(m_prev - safe))
        w = np.exp(e - safe[..., None])                                        # 0 where masked
        l = l_prev * alpha + w.sum(-1)
        o = o_prev * alpha[..., None] + np.einsum("hst,htd->hsd", w, vv)
        if state_out:
            self.access(self._compute, state, write=True)
            st = np.concatenate([o, m[..., None], l[..., None]], axis=-1).transpose(1, 0, 2)   # -> [n_q, h_a, d+2]
            np.ndarray.__setitem__(state, Ellipsis, st.astype(np.float32))
        else:
            np.ndarray.__setitem__(out, Ellipsis, (o / l[..., None]).transpose(1, 0, 2).astype(np.float16))

    def _tokens(self, page_ptrs, page_tokens, num_kv_heads, head_dim, t0, t1):
        """fp32 K and V [h_kv, t1 - t0, d] of tokens [t0, t1) through the page address table."""
        ks, vs = [], []
        for page in range(t0 // page_tokens, (t1 - 1) // page_tokens + 1):
            sl = self._page(int(page_ptrs[page]), (2, num_kv_heads, page_tokens, head_dim))
            a, b = max(t0, page * page_tokens) - page * page_tokens, min(t1, (page + 1) * page_tokens) - page * page_tokens
            ks.append(sl[0, :, a:b])
            vs.append(sl[1, :, a:b])
        return np.concatenate(ks, 1).astype(np.float32), np.concatenate(vs, 1).astype(np.float32)

    def decode_partial(self, q, page_ptrs, page_tokens, step, split_tokens, split_base,
                       n_splits, num_kv_heads, head_dim, scale, part_m, part_s, part_o):
        self.kernel_launches += 1
        n_tokens, t_begin = self._step(step)
        q = np.asarray(q, np.float32)
        h_a = q.shape[0]
        g = h_a // num_kv_heads
        span = split_tokens
        po = part_o.reshape(-1, h_a, head_dim)                             # [rows*d] -> [splits, h_a, d]
        pm = part_m.reshape(-1, h_a)
        ps = part_s.reshape(-1, h_a)
        for split in range(split_base, split_base + n_splits):
            t0, t1 = max(split * span, t_begin), min(n_tokens, (split + 1) * span)
            if t0 >= t1:
                pm[split], ps[split], po[split] = -np.inf, 0, 0
                continue
            k, v = self._tokens(page_ptrs, page_tokens, num_kv_heads, head_dim, t0, t1)   # [h_kv, n, d] each
            qg = q.reshape(num_kv_heads, g, head_dim)                      # [h_a, d] -> [h_kv, g, d]
            e = np.matmul(qg, k.transpose(0, 2, 1)) * np.float32(scale)   # [h_kv, g, n]
            m = e.max(-1)
            w = np.exp(e - m[..., None])
            pm[split] = m.reshape(h_a)
            ps[split] = w.sum(-1).reshape(h_a)
            po[split] = np.matmul(w, v).reshape(h_a, head_dim)

    def has_fused_decode(self, head_dim, group):
        return self.fused

    def decode_fused(self, q, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits, num_kv_heads,
                     head_dim, scale, part_m, part_s, part_o, counters, out, sinks=None):
        assert self.fused and not np.asarray(counters).any(), "the fused kernel's counters must be 0 at launch"
        self.fused_launches += 1
        self.decode_partial(q, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits, num_kv_heads,
                            head_dim, scale, part_m, part_s, part_o)
        self.decode_merge(part_m, part_s, part_o, split_base, split_base + n_splits, q.shape[0], head_dim,
                          q.shape[0] // num_kv_heads, out, sinks)

    def has_fused_append(self, head_dim, group=None):
        return self.fused_append

    def decode_fused_append(self, q, k, v, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits,
                            num_kv_heads, head_dim, scale, part_m, part_s, part_o, counters, out, sinks=None):
        self.fused_append_launches += 1
        self.decode_append(k, v, page_ptrs, page_tokens, num_kv_heads, head_dim, step)
        self.kernel_launches -= 1                        # one launch: the append's count is the fused one's
        self.decode_fused(q, page_ptrs, page_tokens, step, split_tokens, split_base, n_splits, num_kv_heads,
                          head_dim, scale, part_m, part_s, part_o, counters, out, sinks)

    def has_fused_append_batch(self, head_dim, group):
        return self.fused_append_batch

    def _view(self, addr: int, n: int, dtype) -> np.ndarray:
        """n elements of dtype at a device address (a buffer the kernel was handed through a table)."""
        return np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(addr), dtype)

    def decode_fused_append_batch(self, q, k, v, seqs_ptr, n_seqs, max_splits, page_tokens, num_kv_heads, head_dim,
                                  scale, out, sinks=None):
        """The kernel's contract: decode_fused_append of sequence b on rows b of q, k, v, out, with the page table,
        step, partials, counters and splits its row of the table [n_seqs, 9] int64 names; one layer's sinks for all."""
        assert self.fused_append_batch
        self.batch_launches += 1
        launches = self.kernel_launches
        h_a = q.shape[1] // head_dim
        for b, row in enumerate(self._view(seqs_ptr, n_seqs * 9, np.int64).reshape(n_seqs, 9)):
            ptrs, step, pm, ps, po, counters, span, base, n = (int(x) for x in row)
            assert 0 <= n <= max_splits, (n, max_splits)
            if n == 0:
                continue                                  # the short kernel's sequence: its blocks return at once
            step = self._view(step, 2, np.int32)
            rows = (base + n) * h_a
            self.decode_fused_append(
                q[b].reshape(h_a, head_dim), k[b].reshape(num_kv_heads, head_dim), v[b].reshape(num_kv_heads, head_dim),
                self._view(ptrs, -(-int(step[0]) // page_tokens), np.int64), page_tokens, step, span, base, n,
                num_kv_heads, head_dim, scale, self._view(pm, rows, np.float32), self._view(ps, rows, np.float32),
                self._view(po, rows * head_dim, np.float32), self._view(counters, num_kv_heads, np.int32),
                out[b].reshape(h_a, head_dim), sinks)
        self.kernel_launches = launches + 1

    def has_short_decode(self, head_dim, group):
        return self.short

    def decode_short(self, q, page_ptrs, page_tokens, step, num_kv_heads, head_dim, scale, out, sinks=None):
        """The kernel's contract: softmax(q K^T * scale) V over the step's window [t_begin, n_tokens), the sinks in
        the denominator, fp16 out."""
        assert self.short
        self.kernel_launches += 1
        self.short_launches += 1
        n_tokens, t_begin = self._step(step)
        h_a = q.shape[0]
        k, v = self._tokens(page_ptrs, page_tokens, num_kv_heads, head_dim, t_begin, n_tokens)   # [h_kv, n, d] each
        qg = np.asarray(q, np.float32).reshape(num_kv_heads, h_a // num_kv_heads, head_dim)   # -> [h_kv, g, d]
        e = np.matmul(qg, k.transpose(0, 2, 1)) * np.float32(scale)       # [h_kv, g, n]
        m = e.max(-1, keepdims=True)
        sink = None if sinks is None else np.asarray(sinks, np.float32).reshape(qg.shape[0], -1, 1)   # -> [h_kv, g, 1]
        if sink is not None:
            m = np.maximum(m, sink)
        w = np.exp(e - m)
        den = w.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - m))
        o = np.matmul(w, v) / den                                          # [h_kv, g, d]
        out[...] = o.reshape(h_a, head_dim).astype(np.float16)

    def decode_short_append(self, q, k, v, page_ptrs, page_tokens, step, num_kv_heads, head_dim, scale, out,
                            sinks=None):
        self.decode_append(k, v, page_ptrs, page_tokens, num_kv_heads, head_dim, step)
        self.kernel_launches -= 1                        # one launch
        self.decode_short(q, page_ptrs, page_tokens, step, num_kv_heads, head_dim, scale, out, sinks)

    def decode_short_append_batch(self, q, k, v, seqs_ptr, n_seqs, page_tokens, num_kv_heads, head_dim, scale, out,
                                  sinks=None):
        """The kernel's contract: decode_short_append of each sequence whose n_splits field is 0, rows b of q, k,
        v, out; the others untouched."""
        assert self.short
        launches = self.kernel_launches
        h_a = q.shape[1] // head_dim
        for b, row in enumerate(self._view(seqs_ptr, n_seqs * 9, np.int64).reshape(n_seqs, 9)):
            if int(row[8]) != 0:
                continue
            step = self._view(int(row[1]), 2, np.int32)
            self.decode_short_append(
                q[b].reshape(h_a, head_dim), k[b].reshape(num_kv_heads, head_dim), v[b].reshape(num_kv_heads, head_dim),
                self._view(int(row[0]), -(-int(step[0]) // page_tokens), np.int64), page_tokens, step, num_kv_heads,
                head_dim, scale, out[b].reshape(h_a, head_dim), sinks)
        self.kernel_launches = launches + 1

    def decode_merge(self, part_m, part_s, part_o, split_begin, split_end, num_heads, head_dim, group, out, sinks=None):
        pm = part_m.reshape(-1, num_heads)[split_begin:split_end]
        ps = part_s.reshape(-1, num_heads)[split_begin:split_end]
        po = part_o.reshape(-1, num_heads, head_dim)[split_begin:split_end]
        M = pm.max(0)
        if sinks is not None:                            # the sinks join the denominator here, once
            M = np.maximum(M, np.asarray(sinks, np.float32))
        a = np.where(pm == -np.inf, 0, np.exp(pm - M))
        den = (a * ps).sum(0) + (0 if sinks is None else np.exp(np.asarray(sinks, np.float32) - M))
        out[...] = (a[..., None] * po).sum(0) / den[:, None]
