"""A prompt's routed experts of a GPU stage's MoE block, all computed on the GPU: the host experts' weights stream
over PCIe into a ring of staging slots, a group of experts copying while the group before it computes.

Why: a prompt of a few hundred tokens selects nearly every expert of a block, and the CPU's GEMMs over S rows of
each cost far more than its weights crossing once (Qwen3-30B-A3B Q4_K: 2.65 MB an expert, ~50 us at 55 GB/s).
The host experts' rows are page-locked where they lie (cudaHostRegister on the stacked tensors, once when the model
is loaded), so the copies run at the link's rate straight from the bound weights: no second host copy.

Per block (rows grouped by expert once: one sorted index and weight array crosses to the GPU):
    for each expert e with rows, ascending:     x_e = m[rows_e]; y_e = expert_prefill(x_e, weights_e)
                                                h[rows_e] += w_e * y_e        (fp32; each row's experts ascending)
weights_e are the expert's VRAM tensors, or its staging slot's views. Invariant: a slot is overwritten only after
the kernels that read it are done (an event per group, waited on by the copy stream).
"""
from __future__ import annotations

import weakref

import numpy as np

from helmc.runtime.moe_experts import LayerExperts


class ExpertPrefill:
    def __init__(self, expert_fns: dict, moe, staging_bytes: int, to_cupy, from_cupy):
        import cupy as cp

        from helmc.runtime.memory.allocation import allocate
        self.expert_fns = expert_fns                 # {expert signature: the GPU library's expert prefill function}
        self.moe, self.staging_bytes = moe, staging_bytes
        self.to_cupy, self.from_cupy = to_cupy, from_cupy
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self._flat = allocate("weights", staging_bytes, lambda: cp.empty(staging_bytes, cp.uint8),
                              "expert prefill staging")
        self._views: dict = {}                       # per expert layout: [slot] -> (gate, up, down) TVM views
        # host tensors page-locked: {data pointer: (the tensor, kept alive while its pages are locked, [ranges])},
        # unlocked when this object goes (before the tensors can be freed: a freed locked page would stay locked)
        self._registered: dict[int, tuple] = {}
        weakref.finalize(self, _unregister, self._registered)
        self._copied: list = []                      # per slot: the event after its copy
        self._free: list = []                        # per slot: the event after the kernels that read it
        self.streamed_experts = 0
        self.lock_calls = 0                          # cudaHostRegister calls made (once per loaded model)

    def applies(self, experts: LayerExperts) -> bool:
        """Quantized stacked experts with a prefill function, and either room to stage host experts or none."""
        if experts.stacked is None or experts.signature not in self.expert_fns:
            return False
        if len(experts.on_gpu) == self.moe.num_experts:
            return True
        return (all(_rows_bytes(t, self.moe.num_experts) % 256 == 0 for t in experts.stacked)
                and len(self._slot_views(experts)) > 0)

    def lock_host_experts(self, blocks: list[LayerExperts]) -> None:
        """Page-lock the host experts of every block whose prompts stream them, once, when the model is loaded:
        cudaHostRegister of ~14 GB (Qwen3-30B-A3B at 4 GiB) takes about a second, which the first prompt would
        otherwise pay inside its TTFT."""
        for experts in blocks:
            if self.applies(experts) and len(experts.on_gpu) < self.moe.num_experts:
                self._register(experts)

    def add_experts(self, m_dev, idx: np.ndarray, w: np.ndarray, experts: LayerExperts, hc) -> None:
        """hc [S, H] fp32 (device) += each row's selected experts (idx, w [S, k] from route) of m_dev [S, H]."""
        import cupy as cp
        S, k = idx.shape
        flat = idx.ravel()
        order = np.argsort(flat, kind="stable")                          # (row, slot) pairs grouped by expert
        counts = np.bincount(flat, minlength=self.moe.num_experts)
        starts = np.concatenate([[0], np.cumsum(counts)])
        packed = np.concatenate([(order // k).astype(np.int32).view(np.float32), w.ravel()[order]])   # [2 S k]
        dev = cp.asarray(packed)
        rows, weights = dev[:S * k].view(cp.int32), dev[S * k:]
        used = [e for e in range(self.moe.num_experts) if counts[e]]
        host = [e for e in used if e not in experts.on_gpu]
        if host:
            self._register(experts)
        views = self._slot_views(experts) if host else []
        n = len(views)
        fn, compute, j = self.expert_fns[experts.signature], cp.cuda.get_current_stream(), 0
        done = cp.cuda.Event(disable_timing=True)      # the last block's readers of any slot are queued before this
        done.record(compute)
        self.copy_stream.wait_event(done)
        self._copied, self._free = [None] * n, [None] * n
        sources = [(_data_ptr(t), _rows_bytes(t, self.moe.num_experts)) for t in experts.stacked]   # per kind
        for i in range(min(n, len(host))):                               # the first copies, one per slot
            self._copy(sources, host[i], i)
        for e in used:
            if e in experts.on_gpu:
                wts = experts.experts[e]
            else:
                s = j % n
                compute.wait_event(self._copied[s])
                wts = views[s]
            sl = slice(int(starts[e]), int(starts[e + 1]))
            r = rows[sl]
            y = self.to_cupy(fn(self.from_cupy(cp.ascontiguousarray(m_dev[r])), *wts))   # [n_e, H]
            hc[r] += weights[sl, None] * y.astype(cp.float32)
            if e not in experts.on_gpu:
                self._free[s] = cp.cuda.Event(disable_timing=True)
                self._free[s].record(compute)
                if j + n < len(host):                                      # the slot's next expert
                    self._copy(sources, host[j + n], s)
                j += 1
        self.streamed_experts += len(host)

    # ------------------------------------------------------------------ the staging slots
    def _copy(self, sources: list[tuple[int, int]], e: int, s: int) -> None:
        """Queue expert e's rows of each kind (sources: per kind, the stacked tensor's address and one expert's bytes)
        into slot s on the copy stream, after the slot's last readers."""
        import cupy as cp
        if self._free[s] is not None:
            self.copy_stream.wait_event(self._free[s])
        at = self._flat.data.ptr + s * sum(nbytes for _, nbytes in sources)
        for ptr, nbytes in sources:
            cp.cuda.runtime.memcpyAsync(at, ptr + e * nbytes, nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        self.copy_stream.ptr)
            at += nbytes
        self._copied[s] = cp.cuda.Event(disable_timing=True)
        self._copied[s].record(self.copy_stream)

    def _expert_bytes(self, experts: LayerExperts) -> int:
        return sum(_rows_bytes(t, self.moe.num_experts) for t in experts.stacked)

    def _slot_views(self, experts: LayerExperts) -> list:
        """[slot] -> the expert function's weights (gate, up, down) over that slot, for the block's layout."""
        key = tuple(tuple(t.shape) for t in experts.stacked)
        if key not in self._views:
            per = self._expert_bytes(experts)
            out = []
            for s in range(self.staging_bytes // per):
                at, views = s * per, []
                for rows, row_bytes in key:
                    r = rows // self.moe.num_experts
                    views.append(self.from_cupy(self._flat[at:at + r * row_bytes].reshape(r, row_bytes)))
                    at += r * row_bytes
                out.append(tuple(views))
            self._views[key] = out
        return self._views[key]

    def _register(self, experts: LayerExperts) -> None:
        """Page-lock the host experts' rows of the block's stacked tensors once (runs of host experts only: the
        rows of experts in VRAM stay unwritten, never resident)."""
        import cupy as cp
        for whole in experts.stacked:
            ptr = _data_ptr(whole)
            if ptr in self._registered:
                continue
            nbytes = _rows_bytes(whole, self.moe.num_experts)
            locked = []
            for a, b in _runs([e not in experts.on_gpu for e in range(self.moe.num_experts)]):
                try:
                    self.lock_calls += 1
                    cp.cuda.runtime.hostRegister(ptr + a * nbytes, (b - a) * nbytes, 0)
                    locked.append(ptr + a * nbytes)
                except cp.cuda.runtime.CUDARuntimeError:   # pageable: the copies still run, each waiting on the host
                    pass
            self._registered[ptr] = (whole, locked)


def _unregister(registered: dict) -> None:
    """Unlock every locked range (ExpertPrefill's finalizer), then let the tensors go."""
    import cupy as cp
    for _, locked in registered.values():
        for address in locked:
            try:
                cp.cuda.runtime.hostUnregister(address)
            except Exception:        # the CUDA context is already gone at interpreter exit: nothing is locked
                pass
    registered.clear()


def _rows_bytes(t, experts: int) -> int:
    """One expert's bytes of a stacked tensor [experts * rows, row bytes]."""
    rows, row_bytes = t.shape
    return rows // experts * row_bytes


def _data_ptr(t) -> int:
    """A host TVM tensor's data address."""
    return np.from_dlpack(t).ctypes.data


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[(a, b)] the maximal runs of True in flags."""
    out, a = [], None
    for i, f in enumerate(flags + [False]):
        if f and a is None:
            a = i
        elif not f and a is not None:
            out.append((a, i))
            a = None
    return out
