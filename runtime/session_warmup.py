"""What a fresh process's first request would pay once, paid while loading instead (`helmc run`).

A one-shot `helmc run` is a fresh process: its first prefill and its first decode steps are also the first calls of
every compiled function (TVM loads a function's kernels on first call, CuPy compiles its elementwise kernels,
cuBLAS and the prefill kernels pick their algorithms per shape), the first writes into the host KV arena (the OS
commits its pages then), the first decode step of each CUDA-graph key (run eagerly once, captured the next time)
and the cyclic GC walking everything the load made. `warm_up_session` runs a dummy prompt of the request's length
(on an H200, Qwen3-8B all on the GPU, a 2-token dummy left a 128-token prompt's TTFT at 1.5-1.7x a warm process's)
and a few decode steps, commits the host KV rows the request will use, resets the caches and freezes the GC, so
that the request's TTFT and decode rate are those of a warm process. Tokens never depend on it: the caches are
reset, and a reset cache never reads its stale rows.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.runtime.moe_expert_cache import forget_counts

MIN_PROMPT_TOKENS = 2        # more than one row: the prefill functions (and a streamed prefill), not a decode step
DECODE_STEPS = 3             # the first step of a graph key runs eagerly, the second captures, the third replays


@dataclass(frozen=True)
class WarmUp:
    """What warming up did: host KV bytes committed and the seconds it took."""
    kv_bytes: int
    seconds: float


def host_kv_caches(session) -> list:
    """The session's host KV caches (KVCacheCPU): the CPU stage's, whatever the plan."""
    from helmc.runtime.kv.cache_cpu import KVCacheCPU
    caches = []
    if session.cpu_stage is not None:
        caches.append(session.cpu_stage.kv)
    if session.gpu is not None and session.gpu.cpu_kv is not None:
        caches.append(session.gpu.cpu_kv)
    unique = {id(kv): kv for kv in caches if isinstance(kv, KVCacheCPU)}
    return list(unique.values())


def warm_up_session(session, prompt_tokens: int, new_tokens: int) -> WarmUp:
    """Run a dummy prompt of `prompt_tokens` (at least MIN_PROMPT_TOKENS) and DECODE_STEPS decode steps, commit
    the host KV rows of the request's positions (prompt plus new tokens, at most the plan's context), leave every
    cache empty and freeze the GC."""
    t0 = time.perf_counter()
    vocab = session.spec.vocab_size
    context = session.plan.memory.max_context
    session.reset()
    try:
        length = max(MIN_PROMPT_TOKENS, min(int(prompt_tokens), context - DECODE_STEPS - 1))
        ids = [t % vocab for t in range(1, length + 1)]
        session.forward(ids, argmax=True)
        for step in range(DECODE_STEPS):
            session.forward([(step + 1) % vocab], argmax=True)
        session.forward([1], all_logits=False)                 # the sampled path: logits to the host
    finally:
        session.reset()
        forget_counts(session)                  # the VRAM expert cache's counts: the dummy tokens' routing
    tokens = max(0, min(int(prompt_tokens) + int(new_tokens), context))
    kv_bytes = sum(kv.prefault(tokens) for kv in host_kv_caches(session))
    if session.position:
        raise HelmcError(f"warm-up: expected an empty session after it, found {session.position} tokens")
    freeze_gc()
    return WarmUp(kv_bytes, time.perf_counter() - t0)


def freeze_gc() -> int:
    """Collect once, then move every object alive (what loading made: modules, the session, its tensors) into the
    permanent generation, where the cyclic GC no longer walks it. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
