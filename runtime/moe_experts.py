"""A mixture-of-experts block's feed-forward on the CPU stage: the router's top-k, each selected expert once for
all the rows that chose it, the weighted sum.

The compiled parts (compiler/passes/export_moe.py) are position-wise and take weights as parameters, so one
function serves every MoE block and every expert:
    h, m, logits = post_moe(x, attn, w_o, ln2, w_router)     # h = x + o_proj(attn), m = norm(h), fp32 logits
    y            = expert(m_rows, w_gate, w_up, w_down)      # down(silu(gate(m)) * up(m)), fp32 [rows, H]
The routing is NumPy in fp32 as transformers computes it (softmax over the logits, top-k, renormalised when
norm_topk_prob), and each row's sum runs over its experts in ascending expert order whatever else is in the
step, so a row's bits do not depend on the other rows. Decode rows run the expert's GEMV variants (one row, or
the smallest batched variant that holds them, padded; every row bit-identical to its one-row GEMV); prefill rows
(any count) its GEMM variant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from helmc.model.moe import MoeSpec
from helmc.runtime.function_names import block_function_name, moe_expert_rows_name, moe_expert_sum_name


# Rows of a prompt per call of the m-row expert sum: its buffers grow with the (row, expert) pairs of a call.
ROWS_PER_CALL = 256
# top_k sorts rows whole up to this many (~4 us a row of 128 against ~85 us for the partitioned path's fixed cost).
SORT_WHOLE_ROWS = 8

@dataclass(frozen=True)
class LayerExperts:
    """One MoE block's experts' weights on the stage's device: per expert (gate, up, down), the expert
    function's parameter order. One copy, bound from the checkpoint as the block's other weights."""
    experts: tuple[tuple[Any, Any, Any], ...]
    signature: int = 0               # the block's expert type signature (ModelSpec.expert_signatures()): which
                                     # compiled expert function reads these weights
    on_gpu: frozenset = frozenset()  # a GPU stage's block: the experts whose weights are in VRAM (Plan.placement.gpu_experts)
                                     # at load; in_vram() says which are now
    stacked: tuple | None = None     # quantized experts in host RAM: (gate, up, down), each one tensor
                                     # [experts * rows, row bytes] that `experts` are views into (weights/bind.py),
                                     # then gpt-oss's biases stacked (fp32 [E, I], [E, I], [E, H]): the one-call
                                     # sums' arguments after the weights
    vram_stacked: tuple | None = None  # the experts in VRAM, likewise: (gate, up, down) [slots * rows, row bytes],
    vram_order: tuple = ()             # expert vram_order[slot] at slot (at load)
    vram_biases: tuple = ()            # gpt-oss: the VRAM experts' biases by slot, fp32 device tensors [slots, I],
                                       # [slots, I], [slots, H] (the GPU's biased expert kernels' arguments)
    layer: int = -1                    # the block's index (routing statistics count by it)
    # with the VRAM expert cache (Plan.placement.expert_cache): which expert each slot serves now, the one home of
    # residency (moe_expert_cache.ExpertResidency; decode, batched steps and prefill ask it), every slot's views
    # into vram_stacked and every expert's into stacked (each expert's host rows written: one may leave VRAM)
    residency: Any = None
    vram_slots: tuple = ()
    host_views: tuple = ()

    def in_vram(self) -> frozenset:
        """The experts VRAM serves now."""
        return self.residency.resident() if self.residency is not None else self.on_gpu

    def weights(self, e: int) -> tuple:
        """Expert e's (gate, up, down) where it is served now: its VRAM slot's views, or the host's."""
        if self.residency is None:
            return self.experts[e]
        s = int(self.residency.slot_of[e])
        return self.vram_slots[s] if s >= 0 else self.host_views[e]


def find_expert_sums(vm, spec, rows: bool = False) -> dict:
    """{expert signature index: the CPU library's one-call decode expert sum} for the signatures it has
    (schedules/cpu/quant/moe_experts.py; absent for float experts, types without an int8 kernel, older bundles);
    with `rows`, its m-row twin for batched steps (moe_experts_rows.py; absent in older bundles too)."""
    out = {}
    if not (spec.moe.plain_experts or spec.moe.biased_experts):
        return out
    name_of = moe_expert_rows_name if rows else moe_expert_sum_name
    for j, (gate, up, down) in enumerate(spec.expert_signatures()):
        if not (gate and gate == up and down):
            continue
        name = name_of(gate, down, spec.moe.num_experts, spec.moe.expert_intermediate_size,
                       spec.hidden_size, biased=spec.moe.biased_experts)
        try:
            out[j] = vm.module.get_function(name, query_imports=True)
        except AttributeError:
            pass
    return out


def expert_rows_args(idx: np.ndarray, w: np.ndarray, keep: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The m-row expert sum's description of a step (schedules/cpu/quant/moe_experts_rows.py) from route's idx, w
    [m, k] (only the pairs `keep` [m, k] marks, where given): (pair_expert, pair_row, pair_weight, group_start,
    row_pairs, row_start), the pairs sorted by expert then row, each row's pairs listed in ascending expert order."""
    m = idx.shape[0]
    rows, slots = np.nonzero(np.ones(idx.shape, bool) if keep is None else keep)
    experts = idx[rows, slots]
    order = np.lexsort((rows, experts))
    pair_expert, pair_row = experts[order].astype(np.int32), rows[order].astype(np.int32)
    pair_weight = np.ascontiguousarray(w[rows, slots][order], np.float32)
    group_start = np.concatenate([[0], np.flatnonzero(np.diff(pair_expert)) + 1, [pair_expert.size]])
    row_pairs = np.lexsort((pair_expert, pair_row))
    row_start = np.concatenate([[0], np.cumsum(np.bincount(pair_row, minlength=m))])
    return (pair_expert, pair_row, pair_weight, group_start.astype(np.int32), row_pairs.astype(np.int32),
            row_start.astype(np.int32))


def route(logits: np.ndarray, moe: MoeSpec) -> tuple[np.ndarray, np.ndarray]:
    """(experts [S, k] int64, weights [S, k] float32) of router logits [S, E]: softmax in fp32, the k largest
    probabilities (largest first; ties to the lower index), renormalised to sum 1 when norm_topk_prob; for
    routing "topk_softmax" (gpt-oss) the k largest logits, then a softmax in fp32 over those k."""
    if moe.routing == "topk_softmax":
        top = logits.astype(np.float32)
        idx = top_k(top, moe.top_k)
        z = np.take_along_axis(top, idx, axis=-1)
        p = np.exp(z - z[:, :1])                                       # the largest first: its exp is 1
        return idx, (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    idx = top_k(p, moe.top_k)
    w = np.take_along_axis(p, idx, axis=-1)
    if moe.norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w.astype(np.float32)


def top_k(p: np.ndarray, k: int) -> np.ndarray:
    """np.argsort(-p, axis=-1, kind="stable")[:, :k] (the k largest of each row, largest first, ties to the lower
    index) without sorting whole rows: a prompt's [S, E] router rows sorted whole cost ~7 ms a block at S = 2048.
    The k + 1 largest are partitioned out and ordered by (value descending, index); where the k-th and the
    (k + 1)-th tie (or are NaN), a value outside them may tie too, and that row takes the full stable sort."""
    S, E = p.shape
    if k + 1 >= E or S <= SORT_WHOLE_ROWS:     # a decode step's few rows: one small sort beats partition + lexsort
        return np.argsort(-p, axis=-1, kind="stable")[:, :k]
    cand = np.argpartition(-p, k, axis=-1)[:, :k + 1]                   # [S, k + 1]: the k + 1 largest, unordered
    v = np.take_along_axis(p, cand, axis=-1)
    order = np.lexsort((cand, -v), axis=-1)                             # by -v, then by index
    cand, v = np.take_along_axis(cand, order, axis=-1), np.take_along_axis(v, order, axis=-1)
    out = cand[:, :k].astype(np.intp)
    unsure = ~(v[:, k - 1] > v[:, k])                                   # a tie at the boundary, or NaN
    if unsure.any():
        out[unsure] = np.argsort(-p[unsure], axis=-1, kind="stable")[:, :k]
    return out


class OneRowExpertArgs:
    """The arguments of the CPU library's one-call expert sum for one decode row, made once: x fp32 [1, H], the
    selected experts int32 and their weights fp32 [n <= top_k], y fp32 [1, H] (or a caller's buffer, e.g. pinned
    memory), each with its TVM view. Why: a view costs ~15 us to make and a block's call reads a few MB, so three new
    views a call were a fifth of a small call's time. Invariant: one call at a time; the caller writes x, sel[:n] and
    w[:n], then run(), then reads y before the next write."""

    def __init__(self, hidden: int, top_k: int, y: np.ndarray | None = None):
        import tvm.runtime

        from helmc.runtime.memory.allocation import aligned_empty
        from helmc.runtime.tvm_tensors import cpu_tensor_view
        self.x = aligned_empty((1, hidden), np.float32, zero=True)                    # [1, H]
        self.sel = aligned_empty((top_k,), np.int32, zero=True)                       # [K]
        self.w = aligned_empty((top_k,), np.float32, zero=True)                       # [K]
        self.y = aligned_empty((1, hidden), np.float32, zero=True) if y is None else y   # [1, H]
        assert self.y.shape == (1, hidden) and self.y.dtype == np.float32 and self.y.ctypes.data % 64 == 0
        dev = tvm.cpu()
        self._x_view, self._y_view = cpu_tensor_view(self.x, dev), cpu_tensor_view(self.y, dev)
        self._views = {n: (cpu_tensor_view(self.sel[:n], dev), cpu_tensor_view(self.w[:n], dev))
                       for n in range(1, top_k + 1)}

    def run(self, kernel, stacked, n: int) -> None:
        """y = the sum over sel[:n] (ascending) of w[j] * expert_sel[j](x), by `kernel` over the block's stacked
        weights."""
        sel_view, w_view = self._views[n]
        kernel(self._x_view, sel_view, w_view, *stacked, self._y_view)


class MoeFeedForward:
    """The post-attention half of a MoE block, called as the dense post_attn is:
    `ffn(phase, signature)(x, attn, w_o, ln2, w_router, LayerExperts)` -> x' (a device tensor [S, H]), signature
    the block's type signature (its o_proj's type picks the post_moe copy, as post_attn's)."""

    def __init__(self, vm, moe: MoeSpec, phases: tuple[str, ...], batch_sizes: tuple[int, ...],
                 to_array: Callable, from_array: Callable, signatures=(0,), expert_signatures=(0,), xp=np,
                 expert_sums=None, expert_rows=None, int8_prompts: bool = True):
        self.moe = moe
        self.to_array, self.from_array = to_array, from_array
        self.xp = xp                                     # the arrays' module: NumPy on the host, CuPy on a GPU
        self._post = {(p, j): vm[block_function_name("post_moe", p, j)] for p in phases for j in set(signatures)}
        self._expert = {(p, j): vm[block_function_name("expert", p, j)] for p in phases for j in set(expert_signatures)}
        self._decode_rows = (1,) + tuple(batch_sizes)    # the expert's decode variants, by row count
        self._expert_sums = expert_sums or {}            # {expert signature: the one-call decode expert sum}
        self._expert_rows = expert_rows or {}            # {expert signature: its m-row twin, for batched steps}
        self._calls = {(p, j): (lambda *a, _p=p, _j=j: self.forward(_p, *a, signature=_j))
                       for p in phases for j in set(signatures)}
        self.routing = None             # a moe_routing.RoutingCounter while routing statistics are measured
        self._one_row = None            # OneRowExpertArgs, made at the first one-call sum
        self.int8_prompts = int8_prompts  # a prompt's quantized experts through the m-row expert sum (expert_sum)

    def __call__(self, phase: str, signature: int = 0) -> Callable:
        return self._calls[(phase, signature)]

    def forward(self, phase: str, x, attn, *weights, signature: int = 0):
        """weights: post_moe's (ModelSpec.post_attn_weight_names), then the block's LayerExperts."""
        *weights, experts = weights
        h, m, logits = self._post[(phase, signature)](x, attn, *weights)
        h = np.array(self.to_array(h), dtype=np.float32)                  # [S, H], a copy of our own
        return self.from_array(h + self.routed_sum(phase, self.to_array(m), self.to_array(logits), experts))

    def routed_sum(self, phase: str, m: np.ndarray, logits: np.ndarray, experts: LayerExperts) -> np.ndarray:
        """The block's routed feed-forward on host rows: m [S, H] (the experts' input, the stage's activation
        dtype), logits [S, E] the router's -> fp32 [S, H], each row's selected experts weighted and summed
        (without the residual)."""
        idx, w = route(logits, self.moe)
        if self.routing is not None:
            self.routing.record(experts.layer, idx)
        return self.expert_sum(phase, m, idx, w, experts)

    def expert_sum(self, phase: str, m, idx: np.ndarray, w: np.ndarray, experts: LayerExperts, only=None,
                   skip=frozenset()):
        """sum over the selected experts (idx, w [S, k] from route; those in `only` where given, none of `skip`)
        of w * expert(m), fp32 [S, H] in this object's array module, the experts in ascending order: each row's sum
        order fixed."""
        xp = self.xp
        decode = phase != "prefill"
        one_call = self._expert_sums.get(experts.signature) if experts.stacked is not None else None
        if decode and m.shape[0] == 1 and one_call is not None:
            return self._one_call_sum(one_call, m, idx[0], w[0], experts, only, skip)
        rows_call = self._expert_rows.get(experts.signature) if one_call is not None else None
        # A batched step: each row bit-identical to the one-row call above. A prompt: each expert's int8 blocks read
        # once for all its rows of a chunk, the activations int8 as a decode step's (and llama.cpp's q8 ones): the
        # prefill expert function dequantized a whole expert for the few rows each gets (~1.2 s a 128-token
        # prompt's block of Qwen3-30B-A3B on two cores, 0.13 s this way). gpt-oss too, as llama.cpp runs it: its int8
        # rows are as close as the others' (a block's sum 1.1-1.3e-2 from fp32 activations), though its routing
        # softmaxes over the top-k logits alone, so where int8 error swaps the k-th expert at a near tie a row moves
        # by that expert's 0.1-0.3 share (a tiny model's prompt logits by 0.14); the dequantizing path took 21 s for a
        # 128-token prompt of gpt-oss-20b on the H200 host's 16 threads (its ~700 expert calls, ~30 ms each).
        if rows_call is not None and (decode or self.int8_prompts):
            return self._rows_sum(rows_call, m, idx, w, experts, only, skip)
        out = xp.zeros((m.shape[0], m.shape[1]), xp.float32)              # [S, H]
        for e in np.unique(idx):
            if (only is not None and int(e) not in only) or int(e) in skip:
                continue
            rows, slot = np.nonzero(idx == e)
            at = xp.asarray(rows)                   # the rows' indices where m and out are (a copy to a GPU once)
            y = self._run_expert(decode, xp.ascontiguousarray(m[at]), experts.weights(e), experts.signature)
            out[at] += xp.asarray(w[rows, slot, None]) * y
        return out

    def _one_call_sum(self, kernel, m, idx: np.ndarray, w: np.ndarray, experts: LayerExperts, only, skip):
        """One decode row's selected experts (idx, w [k]; within `only`, none of `skip`) through the CPU library's
        one-call expert sum over the block's stacked weights, ascending as expert_sum adds them -> fp32 [1, H]."""
        keep = [j for j in np.argsort(idx, kind="stable")
                if (only is None or int(idx[j]) in only) and int(idx[j]) not in skip]
        if not keep:
            return np.zeros((1, m.shape[1]), np.float32)
        if self._one_row is None:
            self._one_row = OneRowExpertArgs(m.shape[1], self.moe.top_k)
        args, n = self._one_row, len(keep)
        np.copyto(args.x, m, casting="same_kind")                          # [1, H] fp32
        args.sel[:n] = idx[keep]
        args.w[:n] = w[keep]
        args.run(kernel, experts.stacked, n)
        return args.y.copy()                                               # [1, H]: the next call writes args.y

    def _rows_sum(self, kernel, m, idx: np.ndarray, w: np.ndarray, experts: LayerExperts, only, skip):
        """A batched decode step's or a prompt's rows (idx, w [S, k]; the pairs within `only`, none of `skip`)
        through the CPU library's m-row expert sum, ROWS_PER_CALL rows a call: each selected expert run once for the
        rows that chose it -> fp32 [S, H]."""
        keep = np.ones(idx.shape, bool)
        if only is not None:
            keep &= np.isin(idx, list(only))
        if skip:
            keep &= ~np.isin(idx, list(skip))
        if not keep.any():
            return np.zeros((m.shape[0], m.shape[1]), np.float32)
        S = m.shape[0]
        if S > ROWS_PER_CALL:        # a prompt in chunks: the kernel's per-pair buffers stay ~13 MB (Qwen3-30B-A3B)
            return np.concatenate([self._rows_sum(kernel, m[a:a + ROWS_PER_CALL], idx[a:a + ROWS_PER_CALL],
                                                  w[a:a + ROWS_PER_CALL], experts, only, skip)
                                   for a in range(0, S, ROWS_PER_CALL)])                 # [S, H]
        import tvm.runtime

        from helmc.runtime.tvm_tensors import host_view
        y = tvm.runtime.empty((m.shape[0], m.shape[1]), "float32", tvm.cpu())      # [S, H]
        args = (np.ascontiguousarray(m, np.float32),) + expert_rows_args(idx, w, keep)
        kernel(*(self.from_array(a) for a in args), *experts.stacked, y)
        return host_view(y)

    def _run_expert(self, decode: bool, rows: np.ndarray, weights, signature: int = 0) -> np.ndarray:
        """The expert on `rows` [r, H]: decode on the one-row GEMV or the smallest batched variant that holds r
        (padded with zero rows, dropped after), prefill on the GEMM variant with r rows."""
        r = rows.shape[0]
        xp = self.xp
        if not decode:
            return xp.array(self.to_array(self._expert[("prefill", signature)](self.from_array(rows), *weights)))
        n = next(b for b in self._decode_rows if b >= r)
        if n > r:
            rows = xp.concatenate([rows, xp.zeros((n - r, rows.shape[1]), rows.dtype)])
        phase = "decode" if n == 1 else f"decode_b{n}"
        return xp.array(self.to_array(self._expert[(phase, signature)](self.from_array(rows), *weights)))[:r]
