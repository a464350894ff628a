"""What the first requests after `helmc serve` starts would pay once, paid at load instead (load_engine).

Why (GPU machine, Qwen3-8B fp16 hybrid cpu(28) -> cuda(10), --max-batch 8): the batch-8 decode steps'
median was 133 ms but steps 1 and 2 took 996 and 740 ms and step 19 838 ms (the CPU stage nearly all of it), which
cut bench_serve's batch-8 rate from ~60 tok/s to 45. Measured on a CPU-only bundle (2-core VM, Qwen3 of 8 layers
of 1024, max batch 8):
- KV arenas committed on first write: each slot's KVCacheCPU arena is np.empty, so the first K/V rows written into
  a slot never used make the OS commit its pages; on these VMs a fresh 2 MiB costs ~3 ms (1 us once backed), so
  the step that prefilled 8 prompts of 128 tokens into 7 fresh slots took 6.5 s, 4.6 s of it in the KV writes
  (one slot's own prompt: 0.32 s, 0.07 s of attention). prefault_kv commits the rows of the plan's workload
  (prompt + output tokens) of every slot at load.
- Python's cyclic GC: a full (gen-2) collection walks every tracked object; after load that is ~233 k of them
  (TVM, NumPy, the runtime) and took 112-476 ms here, in whichever step it falls. freeze_gc moves everything made
  by the load into the permanent generation (gc.freeze, as vLLM does after start-up), so a later collection walks
  only what serving made since.
- First calls per batch size: each decode_b{S} variant, DecodeBatch / GpuDecodeBatch buffers per S, the hybrid
  batch backend, CuPy's and TVM's allocators. run_batch_sizes runs every variant the engine can reach: dummy
  prompts prefilled together into the slots, two decode steps (a second step is where per-key captures and
  allocator reuse start), every slot freed; the pools are checked empty afterwards.
None of it changes a token: a freed slot's stale rows are never read (attention stops at its length).
"""
from __future__ import annotations

import time
from typing import Callable

from helmc.errors import HelmcError
from helmc.runtime.session_warmup import freeze_gc  # noqa: F401  (load_engine calls warmup.freeze_gc)
from helmc.runtime.stage import batch_phase, decode_batch_sizes, decode_step_rows

DUMMY_PROMPT_TOKENS = 2      # more than one row: the prefill variant (and a streamed prefill), not a decode step
DECODE_STEPS = 2


def warm_up(model, progress: Callable[[str], None] | None = None) -> dict:
    """Prefault every slot's CPU KV, run every decode batch size once, leave every slot and pool empty.
    Returns {"kv_bytes", "kv_s", "sizes": {n sequences: seconds}, "s"}; progress(line) is told each part."""
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    check_empty(model, "before")
    tokens = min(model.session.plan.workload.prompt_len + model.session.plan.workload.output_len, model.max_context)
    t = time.perf_counter()
    nbytes = prefault_kv(model, tokens)
    kv_s = time.perf_counter() - t
    if nbytes:
        say(f"warm-up: CPU KV of {len(cpu_caches(model))} slots committed, their first {tokens} positions "
            f"({nbytes / 2**20:.0f} MiB) in {kv_s:.2f} s")
    sizes = {}
    for n in batch_sizes(model):
        t = time.perf_counter()
        run_batch(model, n)
        sizes[n] = time.perf_counter() - t
        rows = decode_step_rows([1] * n, decode_batch_sizes(model.session.plan.workload.batch))
        say(f"warm-up: {n} sequence{'s' if n > 1 else ''} ({batch_phase(rows)}): prefill + {DECODE_STEPS} decode steps "
            f"in {sizes[n]:.2f} s")
    check_empty(model, "after")
    return {"kv_bytes": nbytes, "kv_s": kv_s, "sizes": sizes, "s": time.perf_counter() - t0}


def batch_sizes(model) -> list[int]:
    """Sequence counts whose decode steps run each compiled variant the engine can reach (1 .. max_batch padded to
    the plan's decode_batch_sizes): for each variant the most sequences that run it, so every slot is used."""
    sizes = decode_batch_sizes(model.session.plan.workload.batch)
    most: dict[int, int] = {}
    for n in range(1, model.max_batch + 1):
        most[decode_step_rows([1] * n, sizes)] = n
    return sorted(most.values())


def run_batch(model, n: int) -> None:
    """Dummy prompts prefilled together into slots 0..n-1, DECODE_STEPS decode steps of all n, the slots freed
    (also when a step fails)."""
    vocab = model.spec.vocab_size
    prompt = [t % vocab for t in range(1, DUMMY_PROMPT_TOKENS + 1)]
    slots = list(range(n))
    try:
        model.prefill_many([(s, prompt) for s in slots])
        for step in range(DECODE_STEPS):
            model.decode(slots, [(step + 1) % vocab] * n)
    finally:
        for s in slots:
            model.free(s)


def cpu_caches(model) -> list:
    """The slots' host KV caches (KVCacheCPU), whatever the plan."""
    from helmc.runtime.kv.cache_cpu import KVCacheCPU
    caches = model.cpu_caches
    if model.hybrid and model.session.cpu_stage is not None:
        caches = [model.session.cpu_stage.kv]
    return [kv for kv in caches or [] if isinstance(kv, KVCacheCPU)]


def prefault_kv(model, tokens: int) -> int:
    """Commit the arena memory of every slot's first `tokens` positions (KVCacheCPU.prefault); bytes written."""
    return sum(kv.prefault(tokens) for kv in cpu_caches(model))


def check_empty(model, when: str) -> None:
    held = [s for s in range(model.max_batch) if model.length(s)]
    if held or model.pages_in_use():
        raise HelmcError(f"warm-up: expected every slot empty {when} it, found slots {held} holding tokens and "
                         f"{model.pages_in_use()} KV pages in use")
