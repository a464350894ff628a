"""What the CPU library's one-call expert sum (schedules/cpu/quant/moe_experts.py, called by
moe_experts.MoeFeedForward for a decode row) reads per second on this machine, at each number of selected experts a
call computes: measured on a loaded Session's own kernel and weights, every routed block's stacked host experts
cycled (a model's experts far exceed the L3, as in decode), random distinct experts per call. The cost model prices
the CPU's share of a token's experts at this rate (helmc/planner/moe.py), at the number of host experts a token is
expected to select per block; the GEMV rate it used before overstated the kernel (~17 GB/s at ~4 experts on 16 cores
against the GEMVs' ~50).
"""
from __future__ import annotations

import time

import numpy as np

from helmc.runtime.moe_experts import LayerExperts

MIN_SECONDS = 0.2          # timed per expert count, at least: rounds over every block until this much has passed
MIN_ROUNDS = 3


def host_feed_forwards(session) -> list:
    """The session's host expert routers (MoeFeedForward): the CPU stage's and the GPU stage's host half."""
    out = []
    cpu = getattr(session, "cpu_stage", None)
    if cpu is not None and getattr(cpu, "_moe", None) is not None:
        out.append(cpu._moe)
    gpu_stage = getattr(getattr(session, "gpu", None), "stage", None)
    moe = getattr(gpu_stage, "_moe", None)
    if moe is not None:
        out.append(getattr(moe, "host", moe))       # GpuMoeFeedForward counts through its host half's counter
    return out


def _host_blocks(session) -> tuple[object, list[LayerExperts]]:
    """(the session's host MoeFeedForward, its routed blocks whose experts go through the one-call sum)."""
    for ffn in host_feed_forwards(session):
        sums = getattr(ffn, "_expert_sums", {})
        stages = [getattr(session, "cpu_stage", None), getattr(getattr(session, "gpu", None), "stage", None)]
        blocks = [b.post[-1] for s in stages if s is not None for b in s.bindings
                  if b.post and isinstance(b.post[-1], LayerExperts) and b.post[-1].stacked is not None
                  and b.post[-1].signature in sums and len(b.post[-1].on_gpu) < len(b.post[-1].experts)]
        if blocks:
            return ffn, blocks
    return None, []


def expert_counts(top_k: int) -> tuple[int, ...]:
    """The selected-expert counts measured: 1, 2, 4, ... up to top_k, and top_k."""
    out, n = [], 1
    while n < top_k:
        out.append(n)
        n *= 2
    return tuple(out) + (top_k,)


def measure_expert_sum(session, seed: int = 0) -> tuple[tuple[str, int, float], ...]:
    """((the experts' gate/up weight type, selected experts per call, GB/s read), ...) of the session's one-call expert
    sum; () where it has none (float experts, no int8 kernel for their types, every expert in VRAM)."""
    ffn, blocks = _host_blocks(session)
    if ffn is None:
        return ()
    spec = session.spec
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, spec.hidden_size)).astype(np.float32)
    out = []
    for sig in sorted({b.signature for b in blocks}):
        mine = [b for b in blocks if b.signature == sig]
        kernel, gate_type = ffn._expert_sums[sig], spec.expert_signatures()[sig][0]
        for n in expert_counts(spec.moe.top_k):
            out.append((gate_type, n, _rate(ffn, kernel, mine, x, n, rng)))
    return tuple(out)


def _rate(ffn, kernel, blocks: list[LayerExperts], x: np.ndarray, n: int, rng) -> float:
    """GB/s of `n` random host experts per call over `blocks`, cycled: bytes of the selected experts / wall time of
    the kernel's calls, made as a decode row makes them (its arguments' views made once, the experts drawn before)."""
    from helmc.runtime.moe_experts import OneRowExpertArgs
    args = OneRowExpertArgs(x.shape[1], max(n, 1))
    args.x[...] = x
    args.w[:] = 1.0 / n

    def draw() -> list[tuple[LayerExperts, np.ndarray]]:
        out = []
        for b in blocks:
            host = np.setdiff1d(np.arange(len(b.experts)), np.fromiter(b.on_gpu, np.int64, len(b.on_gpu)))
            out.append((b, np.sort(rng.choice(host, size=min(n, host.size), replace=False)).astype(np.int32)))
        return out

    def one_round(picks) -> tuple[int, float]:
        read, spent = 0, 0.0
        for b, sel in picks:
            args.sel[:sel.size] = sel
            t0 = time.perf_counter()
            args.run(kernel, b.stacked, sel.size)
            spent += time.perf_counter() - t0
            # the selected experts' weight bytes (the stacked weights; gpt-oss's small fp32 biases after them left out)
            read += sel.size * sum(t.shape[0] * t.shape[1] for t in b.stacked[:3]) // len(b.experts)
        return read, spent
    one_round(draw())                             # first calls: page faults and lazy loads, untimed
    rates, spent = [], 0.0
    while len(rates) < MIN_ROUNDS or spent < MIN_SECONDS:
        read, dt = one_round(draw())
        spent += dt
        rates.append(read / dt / 1e9)
    return float(np.median(rates))


def measure_host_half(session, tokens: int = 32, seed: int = 0) -> float | None:
    """Mean ms of a GPU stage's host half at a routed decode block whose experts are partly on the host
    (moe_decode_row.MoeDecodeRow.host_half: route, the slots and the VRAM experts' launch, the CPU's inputs; its
    expert sum left out), over `tokens` greedy decode steps of a random prompt after as many warm-up steps (CUDA graphs
    captured); None where the session has no such block. The GPU waits this long at each such block, beside the
    copy's own wait: the planner charges it per block (helmc/planner/moe.py)."""
    moe = session.gpu_moe()
    row = getattr(moe, "decode_row", None)
    if row is None:
        return None
    ids = np.random.default_rng(seed).integers(1, session.spec.vocab_size, 16).tolist()
    session.reset()
    session.generate(prompt_ids=ids, max_new_tokens=tokens, stop_at_eos=False)      # warm-up: graphs captured
    session.reset()
    halves, spent = row.host_halves, row.host_half_s
    session.generate(prompt_ids=ids, max_new_tokens=tokens, stop_at_eos=False)
    session.reset()
    n = row.host_halves - halves
    return 1e3 * (row.host_half_s - spent) / n if n else None
