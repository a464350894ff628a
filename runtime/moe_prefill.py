"""A prompt's routed experts of a GPU stage's MoE block, all computed on the GPU: the host experts' weights stream
over PCIe into a ring of staging slots, a group of experts copying while the group before it computes.

Why: a prompt of a few hundred tokens selects nearly every expert of a block, and the CPU's GEMMs over S rows of
each cost far more than its weights crossing once (Qwen3-30B-A3B Q4_K: 2.65 MB an expert, ~50 us at 55 GB/s).
The host experts' rows are page-locked where they lie (cudaHostRegister on the stacked tensors, once when the model
is loaded), so the copies run at the link's rate straight from the bound weights: no second host copy.

Per block (routed on the device where the routing kernel computes route(): moe_decode_row.route_rows; the
(row, expert) pairs grouped by expert on the device, group_pairs: only the per-expert counts cross to the host):
    xs = m[rows]                                  one gather [S k, H], expert e's rows the slice starts[e]:starts[e+1]
    for each expert e with rows, ascending:       ys[slice_e] = expert_prefill(xs[slice_e], weights_e)
    h[r] += sum_j w[r, j] * ys[pos[r, j]]         one combine kernel, fp32, each row's experts ascending (no atomics)
weights_e are the expert's VRAM tensors, or its staging slot's views. Invariant: a slot is overwritten only after
the kernels that read it are done (an event per group, waited on by the copy stream). Biased experts (gpt-oss): the
slots hold the weights; every host expert's biases (a few KB each) are copied to the device once, at load, and
follow its slot's weights as the expert function's last arguments.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from helmc.runtime.moe_decode_row import gpu_routes, route_rows
from helmc.runtime.moe_experts import LayerExperts, route


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
        self._free: list = []                        # per slot: the event after the kernels that read it (None:
                                                     # not read yet this block)
        # per slot, its two events, made once and recorded again (a wait takes the record made before it)
        self._events: list = []
        self._done = cp.cuda.Event(disable_timing=True)   # per block: where the copy stream starts (recorded again)
        self._biases: dict = {}                      # biased experts: per block, each expert's biases on the device
        self.streamed_experts = 0
        self.lock_calls = 0                          # cudaHostRegister calls made (once per loaded model)
        self.times: list | None = None               # per block's timings while a list (the prefill benchmark)

    def applies(self, experts: LayerExperts) -> bool:
        """Quantized stacked experts with a prefill function, and either room to stage host experts or none."""
        if experts.stacked is None or experts.signature not in self.expert_fns:
            return False
        if len(experts.on_gpu) == self.moe.num_experts:
            return True
        return len(self._slot_views(experts)) > 0

    def lock_host_experts(self, blocks: list[LayerExperts]) -> None:
        """Page-lock the host experts of every block whose prompts stream them, once, when the model is loaded:
        cudaHostRegister of ~14 GB (Qwen3-30B-A3B at 4 GiB) takes about a second, which the first prompt would
        otherwise pay inside its TTFT."""
        for experts in blocks:
            if self.applies(experts) and len(experts.on_gpu) < self.moe.num_experts:
                self._register(experts)
                self._device_biases(experts)

    def add_routed(self, m_dev, logits, experts: LayerExperts, hc) -> tuple:
        """hc [S, H] fp32 (device) += each row's experts of m_dev [S, H], routed from the device logits [S, E]: on the
        device where the routing kernel computes route() (the picks never cross; the per-expert counts do), else
        by route() on the host. Returns (idx [S, k], ExpertGroups): device arrays, or host ones from route()."""
        import cupy as cp
        marks = _Marks(cp) if self.times is not None else None
        if gpu_routes(self.moe):
            idx, w = route_rows(logits, self.moe)                        # [S, k] each, on the device
        else:
            idx, w = route(cp.asnumpy(logits), self.moe)
        if marks:
            marks.mark("route")
        return idx, self.add_experts(m_dev, idx, w, experts, hc, marks)

    def add_experts(self, m_dev, idx, w, experts: LayerExperts, hc, marks: "_Marks | None" = None) -> "ExpertGroups":
        """hc [S, H] fp32 (device) += each row's selected experts (idx, w [S, k] as route gives them, host or device
        arrays) of m_dev [S, H]; returns the pairs' ExpertGroups (grouped on the device: only the counts crossed)."""
        import cupy as cp
        S, k = idx.shape
        if marks is None and self.times is not None:
            marks = _Marks(cp)
        g = group_pairs(cp.asarray(idx), cp.asarray(w), self.moe.num_experts, cp)
        compute = cp.cuda.get_current_stream()
        pairs = S * k                                                    # rows past them: padding (bucket_rows)
        xs = cp.empty((pairs + pairs // 4 + 16, m_dev.shape[1]), m_dev.dtype)   # [S k + pad, H]
        cp.take(m_dev, g.rows, axis=0, out=xs[:pairs])                   # expert e's rows a slice
        xs[pairs:] = 0
        if marks:
            marks.mark("gather")
        ys = self._run_experts(xs, g, experts, compute, marks)           # [S k, H]: each pair's expert output
                                                                         # (over xs: one [S k, H] buffer a block)
        if marks:
            marks.mark("experts")
        _combine_kernel()(ys, g.pos, g.weights, np.int64(hc.shape[1]), np.int32(k), hc, size=hc.size)
        if marks:
            marks.mark("combine")
            self.times.append(marks.finish(len(g.used()), sum(e not in experts.in_vram() for e in g.used())))
        return g

    def _run_experts(self, xs, g: "ExpertGroups", experts: LayerExperts, compute, marks):
        """Each expert with rows, ascending, over its slice of xs into its slice of one output buffer; the host ones'
        weights streamed through the staging slots, one copying while others compute."""
        import cupy as cp
        used = g.used()
        vram = experts.in_vram()                   # now: the VRAM expert cache moves experts between slots
        host = [e for e in used if e not in vram]
        if host:
            self._register(experts)
        views = self._slot_views(experts) if host else []
        n = len(views)
        fn, j, ys, starts = self.expert_fns[experts.signature], 0, None, g.starts.tolist()
        self._done.record(compute)                     # the last block's readers of any slot are queued before this
        self.copy_stream.wait_event(self._done)
        while len(self._events) < n:
            self._events.append((cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)))
        self._copied, self._free = [ev for ev, _ in self._events[:n]], [None] * n
        sources = [(_data_ptr(t), _rows_bytes(t, self.moe.num_experts)) for t in staged_weights(experts)] \
            if host else []
        biases = self._device_biases(experts) if host else None
        for i in range(min(n, len(host))):                               # the first copies, one per slot
            self._copy(sources, host[i], i)
        for e in used:
            if e in vram:
                wts = experts.weights(e)
            else:
                s = j % n
                if marks:
                    marks.wait(compute, self._copied[s])
                else:
                    compute.wait_event(self._copied[s])
                wts = views[s] + (biases[e] if biases else ())
            a, b = starts[e], starts[e + 1]
            x = xs[a:a + bucket_rows(b - a)]           # the rows past b (the next experts' or padding): ignored
            x = self.from_cupy(x if x.data.ptr % 64 == 0 else x.copy())
            t = time.perf_counter() if marks else 0.0
            y = fn(x, *wts)                                                # [n_e, H], TVM's
            if marks:
                marks.calls += time.perf_counter() - t
            if ys is None:         # in place where it can: slice e is read only by its own expert, queued before
                first = self.to_cupy(y)
                same = first.dtype == xs.dtype and first.shape[1] == xs.shape[1]
                ys = xs if same else cp.empty((xs.shape[0], first.shape[1]), first.dtype)
            _copy_rows(cp, ys, a, b - a, y, compute, self.to_cupy)
            if e not in vram:
                self._free[s] = self._events[s][1]
                self._free[s].record(compute)
                if j + n < len(host):                                      # the slot's next expert
                    self._copy(sources, host[j + n], s)
                j += 1
        self.streamed_experts += len(host)
        return ys

    # ------------------------------------------------------------------ the staging slots
    def _copy(self, sources: list[tuple[int, int]], e: int, s: int) -> None:
        """Queue expert e's rows of each kind (sources: per kind, the stacked tensor's address and one expert's bytes)
        into slot s on the copy stream, after the slot's last readers."""
        import cupy as cp
        if self._free[s] is not None:
            self.copy_stream.wait_event(self._free[s])
        at = self._flat.data.ptr + s * sum(_aligned(nbytes) for _, nbytes in sources)
        for ptr, nbytes in sources:
            cp.cuda.runtime.memcpyAsync(at, ptr + e * nbytes, nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        self.copy_stream.ptr)
            at += _aligned(nbytes)
        self._copied[s].record(self.copy_stream)

    def _expert_bytes(self, experts: LayerExperts) -> int:
        return expert_slot_bytes(experts, self.moe.num_experts)

    def _device_biases(self, experts: LayerExperts) -> tuple | None:
        """Biased experts (gpt-oss): [expert] -> its biases (gate, up, down) on the device in the expert function's
        dtype, copied from the host's once per block (~17 KB an expert at gpt-oss-20b's size; the plan counts them
        in Plan.memory.expert_staging_bytes); None for experts without biases."""
        if not self.moe.expert_bias:
            return None
        if experts.layer not in self._biases:
            import cupy as cp

            from helmc.runtime.memory.allocation import allocate
            on_host = [e for e in range(self.moe.num_experts) if e not in experts.on_gpu]    # VRAM ones have theirs
            host = {e: [np.from_dlpack(b) for b in experts.experts[e][3:]] for e in on_host}
            nbytes = sum(b.nbytes for per in host.values() for b in per)
            copies = allocate("weights", nbytes, lambda: {e: [cp.asarray(b) for b in per] for e, per in host.items()},
                              "expert prefill biases")
            self._biases[experts.layer] = [tuple(self.from_cupy(b) for b in copies[e]) if e in copies else ()
                                           for e in range(self.moe.num_experts)]
        return self._biases[experts.layer]

    def _slot_views(self, experts: LayerExperts) -> list:
        """[slot] -> the expert function's weights (gate, up, down) over that slot, for the block's layout."""
        key = tuple(tuple(t.shape) for t in staged_weights(experts))
        if key not in self._views:
            per = self._expert_bytes(experts)
            out = []
            for s in range(self.staging_bytes // per):
                at, views = s * per, []
                for rows, row_bytes in key:
                    r = rows // self.moe.num_experts
                    views.append(self.from_cupy(self._flat[at:at + r * row_bytes].reshape(r, row_bytes)))
                    at += _aligned(r * row_bytes)
                out.append(tuple(views))
            self._views[key] = out
        return self._views[key]

    def _register(self, experts: LayerExperts) -> None:
        """Page-lock the host experts' rows of the block's stacked tensors once (runs of host experts only: the
        rows of experts in VRAM stay unwritten, never resident; all of them under the VRAM expert cache, which
        writes every expert's rows and copies them into its slots from here too)."""
        import cupy as cp
        for whole in staged_weights(experts):
            ptr = _data_ptr(whole)
            if ptr in self._registered:
                continue
            nbytes = _rows_bytes(whole, self.moe.num_experts)
            locked = []
            written = [experts.residency is not None or e not in experts.on_gpu for e in range(self.moe.num_experts)]
            for a, b in _runs(written):
                try:
                    self.lock_calls += 1
                    cp.cuda.runtime.hostRegister(ptr + a * nbytes, (b - a) * nbytes, 0)
                    locked.append(ptr + a * nbytes)
                except cp.cuda.runtime.CUDARuntimeError:   # pageable: the copies still run, each waiting on the host
                    pass
            self._registered[ptr] = (whole, locked)


@dataclass(frozen=True)
class ExpertGroups:
    """A block's (row, expert) pairs in expert order: expert e's pairs at starts[e]:starts[e + 1], their rows
    ascending, so one gather of the rows makes each expert's input a contiguous slice; pos and weights give each
    row's experts in ascending expert order (the fixed order its sum is added in, as the CPU stage adds it).
    rows, pos and weights are arrays of the module that grouped them (CuPy: they stay on the device); starts is
    always on the host (the expert loop slices by it)."""
    rows: Any                 # [S k] int32: the row of m each sorted pair reads
    starts: np.ndarray        # [E + 1] int64, host
    pos: Any                  # [S, k] int32: row r's j-th expert (ascending) -> its pair's sorted position
    weights: Any              # [S, k] float32: that pair's routing weight

    def used(self) -> list[int]:
        """The experts with rows, ascending."""
        return np.flatnonzero(np.diff(self.starts)).tolist()

    def counts(self) -> np.ndarray:
        """[E] int64: how many rows selected each expert."""
        return np.diff(self.starts)


def group_pairs(idx, w, num_experts: int, xp=np) -> ExpertGroups:
    """ExpertGroups of route's idx, w [S, k] (each row's experts distinct), computed with `xp` (NumPy, or CuPy on
    device arrays: a bincount, two sorts and a scatter; only the [E] counts cross to the host)."""
    S, k = idx.shape
    n = S * k
    flat = idx.reshape(-1)
    # pairs by expert, then by row (then by j, as a stable sort of the experts orders them): the keys are distinct,
    # so any sort gives that one order
    keys = flat.astype(xp.int64) * max(n, 1) + xp.arange(n, dtype=xp.int64)
    order = xp.argsort(keys)
    inverse = xp.empty(n, xp.int32)
    inverse[order] = xp.arange(n, dtype=xp.int32)                    # pair (r, j) -> its sorted position
    ascending = xp.argsort(idx, axis=1)                              # each row's experts ascending (distinct)
    pos = xp.take_along_axis(inverse.reshape(S, k), ascending, axis=1)
    weights = xp.take_along_axis(xp.asarray(w, xp.float32), ascending, axis=1)
    starts = np.concatenate([[0], np.cumsum(_counts(flat, num_experts, xp))]).astype(np.int64)   # last: the one wait
    return ExpertGroups((order // k).astype(xp.int32), starts, xp.ascontiguousarray(pos, xp.int32),
                        xp.ascontiguousarray(weights, xp.float32))


def _counts(flat, num_experts: int, xp) -> np.ndarray:
    """[E] pairs per expert on the host: NumPy's bincount, or on the device one atomic add a pair and one copy back
    (CuPy's bincount waits on the device twice more, checking the values' range; the router's picks are in it)."""
    if xp is np:
        return np.bincount(flat, minlength=num_experts)
    counts = xp.zeros(num_experts, xp.int32)
    _count_kernel()(flat, counts)
    return counts.get()


_count = None


def _count_kernel():
    global _count
    if _count is None:
        import cupy as cp
        _count = cp.ElementwiseKernel("T e", "raw int32 counts", "atomicAdd(&counts[e], 1)", "helmc_moe_expert_counts")
    return _count


# hc[r, c] += w[r, j] * ys[pos[r, j], c] for j ascending: the product rounded, then the add (no FMA), each row's
# experts in ascending order: the bits of adding each expert's weighted rows in turn.
_COMBINE_SOURCE = r"""
const long long r = i / H, c = i % H;
float acc = hc[i];
for (int j = 0; j < K; ++j) {
    const long long p = pos[r * K + j];
    acc = __fadd_rn(acc, __fmul_rn(wt[r * K + j], (float)ys[p * H + c]));
}
hc[i] = acc;
"""
_combine = None


def _combine_kernel():
    global _combine
    if _combine is None:
        import cupy as cp
        _combine = cp.ElementwiseKernel("raw T ys, raw int32 pos, raw float32 wt, int64 H, int32 K",
                                        "raw float32 hc", _COMBINE_SOURCE, "helmc_moe_prefill_combine")
    return _combine


def bucket_rows(n: int) -> int:
    """The rows an expert call is made with for n rows: n rounded up to one of four steps an octave (at most a
    quarter more, 16 at least). Why: the GPU library's pooled allocator keeps a freed buffer for each size it saw,
    and a call per distinct count held ~10 GiB of VRAM after 2048-token prompts; a few dozen sizes bound it."""
    if n <= 16:
        return 16
    step = 1 << (n.bit_length() - 3)               # n in [2^(b-1), 2^b): steps of 2^(b-3)
    return -(-n // step) * step


def _copy_rows(cp, ys, at: int, n: int, y, stream, to_cupy) -> None:
    """ys[at:at + n] = y[:n] (the expert function's TVM tensor [>= n, H]), one device copy on `stream` from its
    address (no DLPack round trip an expert)."""
    H = int(y.shape[1])
    if str(y.dtype) == str(ys.dtype) and H == ys.shape[1]:
        cp.cuda.runtime.memcpyAsync(ys.data.ptr + at * H * ys.itemsize, y.data_ptr(), n * H * ys.itemsize,
                                    cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    else:
        ys[at:at + n] = to_cupy(y)[:n]


class _Marks:
    """A block's timings (ExpertPrefill.times): GPU events and host clocks at each mark, and the compute stream's
    waits on the staging copies."""

    def __init__(self, cp):
        self.cp, self.marks, self.waits = cp, [], []
        self.calls = 0.0                 # host seconds inside the expert function's calls (the VM's, not ours)
        self.mark("start")

    def mark(self, name: str) -> None:
        ev = self.cp.cuda.Event()
        ev.record()
        self.marks.append((name, ev, time.perf_counter()))

    def wait(self, compute, copied) -> None:
        before, after = self.cp.cuda.Event(), self.cp.cuda.Event()
        before.record(compute)
        compute.wait_event(copied)
        after.record(compute)
        self.waits.append((before, after))

    def finish(self, experts: int, streamed: int) -> dict:
        """{phase: (GPU ms, host ms)} from the mark before to each mark, "wait": the GPU ms the compute stream stood
        waiting for copies, "calls_host": the host ms inside the expert function's calls; the block's expert and
        streamed counts."""
        self.marks[-1][1].synchronize()
        cp = self.cp
        out = {"experts_run": experts, "streamed": streamed, "calls_host": 1e3 * self.calls,
               "wait": sum(cp.cuda.get_elapsed_time(a, b) for a, b in self.waits)}
        for (_, e0, t0), (name, e1, t1) in zip(self.marks, self.marks[1:]):
            out[name] = (cp.cuda.get_elapsed_time(e0, e1), 1e3 * (t1 - t0))
        return out


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


def device_bias_bytes(moe, hidden: int, dtype_bytes: int, blocks: int) -> int:
    """The VRAM of Plan.memory.expert_staging_bytes that ExpertPrefill keeps for biases (_device_biases), not slots: every
    expert's gate, up and down biases of `blocks` routed GPU blocks in the activations' dtype (an upper bound: the
    VRAM experts' own are reused); 0 for experts without biases."""
    if not moe.expert_bias:
        return 0
    return blocks * moe.num_experts * (2 * moe.expert_intermediate_size + hidden) * dtype_bytes


def staged_weights(experts: LayerExperts) -> tuple:
    """The stacked host tensors a staging slot holds a row-run of: (gate, up, down); gpt-oss's bias stacks after them
    in LayerExperts.stacked stay out (ExpertPrefill._device_biases)."""
    return experts.stacked[:3]


def expert_slot_bytes(experts: LayerExperts, num_experts: int) -> int:
    """One staging slot's bytes for a block's experts: one expert's rows of each stacked weight, each kind's start
    aligned (_aligned)."""
    return sum(_aligned(_rows_bytes(t, num_experts)) for t in staged_weights(experts))


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to 256: where the next kind's rows start in a slot (the expert function's weights start
    on 256-byte boundaries, as the allocator's tensors do; gpt-oss-20b's MXFP4 expert is 4,406,400 bytes a kind)."""
    return -(-nbytes // 256) * 256


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
