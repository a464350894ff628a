"""Where a mixture of experts' prompt goes on the GPU machine: TTFT of one long prompt, then each MoE block's
expert prefill split into its parts (runtime/moe_prefill.py).

    python benchmarks/device/time_moe_prefill.py --bundle .devrt/moe4 --weights Qwen3-30B-A3B-Q4_K.gguf \
        [--prompt-len 2048] [--runs 3]

Prints the TTFT of --runs prompts of --prompt-len tokens after one warm-up (as bench_moe times them), the same
prompts with the expert prefill's rows routed on the host instead (where the GPU routes them), then one more
prompt with ExpertPrefill.times on (each block synchronised once at its end, so that run's TTFT is a little longer)
and per MoE block, averaged and summed over the blocks: the gather of every (row, expert) pair's input, the expert
calls (the compute stream's waits on the staging copies shown apart), the combine, GPU ms from CUDA events and host
ms of Python, after the routing (on the GPU where its kernel routes the model, else route() on the host); and each
expert call's host and GPU microseconds. A short table on stdout.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def prompt(n: int, vocab: int, seed: int = 2) -> list[int]:
    """bench_moe's long prompt (its prompt_ids with seed 2): the same tokens, the same routing."""
    return [int(t) for t in np.random.default_rng(seed).integers(10, min(vocab, 30000), n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--weights", required=True, help="the GGUF file or model directory the bundle was built from")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()

    from helmc.runtime.moe_decode_row import gpu_routes
    from helmc.runtime.session import Session
    t = time.perf_counter()
    s = Session.load(a.bundle, weights_dir=a.weights)
    print(f"loaded {a.bundle} in {time.perf_counter() - t:.1f} s: plan {s.plan.describe()}, prefill chunk "
          f"{s.plan.placement.prefill_chunk_tokens or 'whole'} tokens, expert staging "
          f"{s.plan.memory.expert_staging_bytes / 2 ** 20:.0f} MiB")
    kv = s.gpu.stage.kv if s.gpu is not None and s.gpu.stage is not None else None
    if kv is not None and kv.ops is not None:    # a cubin from an older build lacks the current kernel's symbol
        flash = kv.ops.has_flash(s.spec.head_dim, s.spec.group_size)
        print("prefill attention: " + ("flash_prefill (tensor cores)" if flash else
                                       "NO flash_prefill in this bundle's cubin: the slower kernels (rebuild it)"))
    ids = prompt(a.prompt_len, s.spec.vocab_size)

    def ttft() -> float:
        return s.generate(prompt_ids=ids, max_new_tokens=1, temperature=0.0, stop_at_eos=False).ttft_ms
    ttft()                                                                   # warm-up
    runs = [ttft() for _ in range(a.runs)]
    print(f"TTFT of {a.prompt_len} tokens: {', '.join(f'{r:.1f}' for r in runs)} ms "
          f"(median {statistics.median(runs):.1f})")
    if gpu_routes(s.spec.moe):          # the same prompts routed by route() on the host, for the difference
        from helmc.runtime import moe_prefill
        moe_prefill.gpu_routes = lambda moe: False
        try:
            host = [ttft() for _ in range(a.runs)]
        finally:
            moe_prefill.gpu_routes = gpu_routes
        print(f"TTFT routed on the host (route(), the logits copied down): {', '.join(f'{r:.1f}' for r in host)} ms "
              f"(median {statistics.median(host):.1f})")

    moe = s.gpu.stage._moe if s.gpu is not None and s.gpu.stage is not None else None
    if moe is None or moe.prefill is None:
        print("no MoE block on the GPU stage: nothing to split")
        return
    moe.prefill.times = []
    try:
        profiled = ttft()
    finally:
        times, moe.prefill.times = moe.prefill.times, None
    if not times:
        print("no block took the GPU's expert prefill (no staging for its host experts?)")
        return
    print(f"profiled prompt: TTFT {profiled:.1f} ms, {len(times)} block calls")
    where = "GPU (route_rows)" if gpu_routes(s.spec.moe) else "host (route)"
    print(f"routing on the {where}; the pairs grouped on the GPU (group_pairs: only the per-expert counts cross)")
    rows = [("routing", "route"), ("group, counts, gather", "gather"), ("expert calls", "experts"),
            ("combine", "combine")]
    print(f"{'per MoE block':<26}{'GPU ms':>10}{'host ms':>10}{'GPU ms, all':>14}{'host ms, all':>14}")
    for label, key in rows:
        gpu = [b[key][0] for b in times]
        host = [b[key][1] for b in times]
        print(f"{label:<26}{np.mean(gpu):>10.3f}{np.mean(host):>10.3f}{sum(gpu):>14.1f}{sum(host):>14.1f}")
    wait = [b["wait"] for b in times]
    print(f"{'  of which copy waits':<26}{np.mean(wait):>10.3f}{'':>10}{sum(wait):>14.1f}")
    run = sum(b["experts_run"] for b in times)
    print(f"experts run per block {run / len(times):.1f}, streamed {np.mean([b['streamed'] for b in times]):.1f}; "
          f"per expert call: host {sum(b['experts'][1] for b in times) * 1e3 / max(run, 1):.0f} us (inside the TVM "
          f"function {sum(b['calls_host'] for b in times) * 1e3 / max(run, 1):.0f} us), "
          f"GPU {sum(b['experts'][0] for b in times) * 1e3 / max(run, 1):.0f} us")


if __name__ == "__main__":
    main()
