"""Batched decode of `helmc serve`'s engine against llama.cpp's llama-batched-bench, in the same run.

    python -m benchmarks.bench_serve BUNDLE [--concurrency 8] [--prompt-len 128] [--new-tokens 128] [--out serve.json] [--no-warm-up]
        [--llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf model.gguf --ngl 16]

The engine runs in this process (no HTTP: what is measured is the model's batched step). Each of N random
prompts first runs alone (decode tok/s at 1), then all N run at once; greedy with EOS ignored, so every request
makes exactly --new-tokens tokens, and each request's tokens at N must equal its tokens alone. The bundle's plan
must be made for N (`helmc build ... --max-batch N`). llama-batched-bench runs with -npp/-ntg the same and
-npl 1,N. The figures at N, each named for what it divides:
  decode_steps_tok_s_at_N      tokens made in the engine steps where all N sequences decoded and no prompt was
                               prefilled, over those steps' time: llama-batched-bench's S_TG (B*TG / T_TG, its
                               T_TG the time of the TG steps that decode all B sequences, the prompts' T_PP apart,
                               tools/batched-bench/batched-bench.cpp). serve_decode_ratio_vs_llamacpp is this over
                               its S_TG at N: the like-for-like ratio.
  decode_tok_s_total_at_N      every sequence's tokens after its first, from the last first token to the last token
                               (all prefills done; the figure earlier runs reported).
  step_split_at_1 / _at_N      median ms of those pure decode steps, of their CPU-stage part and of its attention
                               (the rest of a step: the GPU stage, the head, the crossing, the host's bookkeeping);
                               for a batched hybrid plan also the host's waits for the streamed groups (their copies
                               and kernels: hybrid_wait_ms) and the resident blocks with the head (resident_ms).
  end_to_end_tok_s_at_N        all N x --new-tokens tokens from the submission to the last token, prefills included;
                               serve_end_to_end_ratio_vs_llamacpp is this over llama's B*TG / (T_PP + T_TG).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def run_requests(engine, prompts, new_tokens: int, tag: str, steps: list | None = None) -> list[dict]:
    """Submit every prompt at once and drive the engine until all finish; per request its tokens and times. Each
    engine step's seconds, sequences decoded and prompts prefilled go to `steps` when given."""
    from helmc.runtime.sampling import SamplingParams
    from helmc.runtime.serve.protocol import Request
    out = []
    for i, p in enumerate(prompts):
        rec = {"tokens": [], "stamps": [], "t_submit": time.perf_counter(), "done": None}

        def sink(c, rec=rec):
            rec["tokens"].extend(c.token_ids)
            rec["stamps"].append(time.perf_counter())
            if c.finish_reason:
                rec["done"] = c
        engine.submit(Request(f"{tag}-{i}", tuple(p), SamplingParams(max_tokens=new_tokens, ignore_eos=True)), sink)
        out.append(rec)
    while any(r["done"] is None for r in out):
        rows, firsts, t = engine.decode_rows, sum(bool(r["stamps"]) for r in out), time.perf_counter()
        before, sys0 = {key: acc[0] for key, acc in TIMERS.items()}, system_counters()
        engine.step()
        if steps is not None:
            sys1 = system_counters()
            steps.append(dict({"s": time.perf_counter() - t, "decoded": engine.decode_rows - rows,
                               "prefilled": sum(bool(r["stamps"]) for r in out) - firsts,
                               "system": {k: round(v - sys0.get(k, 0), 3) for k, v in sys1.items()}},
                              **{key: acc[0] - before[key] for key, acc in TIMERS.items()}))
    bad = [r["done"].error for r in out if r["done"].finish_reason != "length"]
    if bad:
        raise RuntimeError(f"bench_serve: a request ended early: {bad[0]}")
    return out


CPU_STAGE_S = [0.0]     # seconds spent in the CPU stage's forward_batch (time_cpu_stage)
CPU_ATTN_S = [0.0]      # of which in its attention (Stage.attend_rows: KV append, attention, output rows)
HYBRID_WAIT_S = [0.0]   # batched hybrid decode: the host waiting for each streamed group (its copy and kernels)
RESIDENT_S = [0.0]      # batched hybrid decode: the resident blocks, the head and the logits back
MODEL_S = [0.0]         # the model's decode call (the rest of a step: sampling, detokenizing, the clients' chunks)
STREAMED_GPU_S = [0.0]  # batched hybrid decode: the host enqueuing the streamed groups' GPU work
GPU_TABLE_S = [0.0]     # batched GPU attention: building the sequences' step tables (kv/decode_batch_gpu.py)
TIMERS = {"cpu_s": CPU_STAGE_S, "attn_s": CPU_ATTN_S, "wait_s": HYBRID_WAIT_S, "resident_s": RESIDENT_S,
          "model_s": MODEL_S, "sgpu_s": STREAMED_GPU_S, "table_s": GPU_TABLE_S}


VMSTAT = ("pgfault", "pgmajfault", "thp_fault_alloc", "compact_stall", "pgmigrate_success", "numa_hint_faults",
          "thp_collapse_alloc")


def system_counters() -> dict:
    """This process's CPU seconds in user and kernel mode and the kernel's counters of the VMSTAT events (Linux),
    so that a slow step says whether the time went to faults, compaction or page migration rather than kernels."""
    t = os.times()
    out = {"user_s": t.user, "system_s": t.system}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in VMSTAT:
                    out[name] = int(value)
    except OSError:
        pass
    return out


def _timed(inner, acc: list):
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t
    return timed


def time_cpu_stage(model) -> None:
    """Count the CPU stage's share of each engine step and its attention's (both synchronous: the host computes
    them), by wrapping the stage's forward_batch and its attend_rows (per block: every sequence's KV append and
    attention and the output rows; wrapping each cache's attend alone would miss them: the batched decode path
    does not call it)."""
    model.decode = _timed(model.decode, MODEL_S)
    from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
    GpuDecodeBatch._step_table = _timed(GpuDecodeBatch._step_table, GPU_TABLE_S)
    stage = model.session.cpu_stage
    if stage is None:
        return
    stage.forward_batch = _timed(stage.forward_batch, CPU_STAGE_S)
    stage.attend_rows = _timed(stage.attend_rows, CPU_ATTN_S)
    if model.session.plan.placement.is_hybrid and model.max_batch > 1:
        # The batched schedule's backend is made on the first step: time its class's two synchronous crossings.
        from helmc.runtime.hybrid.batch import BatchHybridBackend
        BatchHybridBackend.to_host = _timed(BatchHybridBackend.to_host, HYBRID_WAIT_S)
        BatchHybridBackend.resident = _timed(BatchHybridBackend.resident, RESIDENT_S)
        BatchHybridBackend.gpu = _timed(BatchHybridBackend.gpu, STREAMED_GPU_S)


SPLIT_PARTS = (("step_ms", "s"), ("model_ms", "model_s"), ("cpu_stage_ms", "cpu_s"), ("cpu_attention_ms", "attn_s"),
               ("hybrid_wait_ms", "wait_s"), ("resident_ms", "resident_s"), ("streamed_gpu_ms", "sgpu_s"),
               ("gpu_table_ms", "table_s"))


def step_split(steps: list[dict], n: int, slowest: int = 5) -> dict:
    """Median ms of the pure decode steps of n sequences and of their parts, their mean, and the `slowest` of them
    with their parts and index among all steps: a mean far over the median (191.6 against
    119.4 ms in one run) is a few slow steps, and their parts say where."""
    pure = [(i, s) for i, s in enumerate(steps) if s["decoded"] == n and not s["prefilled"]]
    if not pure:
        return {}
    out = {name: 1000 * float(np.median([s[key] for _, s in pure])) for name, key in SPLIT_PARTS}
    out["step_ms_mean"] = 1000 * float(np.mean([s["s"] for _, s in pure]))
    out["slowest"] = [dict({"step": i, "system": s.get("system", {})},
                           **{name: round(1000 * s[key], 2) for name, key in SPLIT_PARTS})
                      for i, s in sorted(pure, key=lambda p: -p[1]["s"])[:slowest]]
    out["median_system"] = {k: float(np.median([s.get("system", {}).get(k, 0) for _, s in pure]))
                            for k in pure[0][1].get("system", {})}
    return out


def decode_rate(recs: list[dict]) -> float:
    """All sequences' tokens after their first, per second from the last first token to the last token."""
    t0 = max(r["stamps"][0] for r in recs)
    t1 = max(r["stamps"][-1] for r in recs)
    n = sum(sum(1 for s in r["stamps"] if s > t0) for r in recs)
    return n / (t1 - t0) if t1 > t0 else 0.0


def decode_steps_rate(steps: list[dict], n: int) -> float:
    """Tokens per second of the steps in which all n sequences decoded and no prompt was prefilled (S_TG's)."""
    pure = [s for s in steps if s["decoded"] == n and not s["prefilled"]]
    return sum(s["decoded"] for s in pure) / sum(s["s"] for s in pure) if pure else 0.0


def end_to_end_rate(recs: list[dict]) -> float:
    """All sequences' tokens per second from the first submission to the last token."""
    return sum(len(r["tokens"]) for r in recs) / (max(r["stamps"][-1] for r in recs) - min(r["t_submit"] for r in recs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-batched-bench", default=None, help="llama.cpp's llama-batched-bench binary")
    ap.add_argument("--gguf", default=None, help="the GGUF file llama-batched-bench runs (the same model)")
    ap.add_argument("--ngl", default="0", help="llama.cpp's -ngl (layers on the GPU), or several comma-separated: "
                    "each is run, and the first names the plain ratios")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--weights", default=None, help="model directory or GGUF file overriding the bundle's")
    ap.add_argument("--profile", default=None, help="plan the bundle again for this `helmc profile` of the machine "
                    "(what `helmc plan BUNDLE PROFILE -o plan.json; helmc serve BUNDLE --plan plan.json` runs)")
    ap.add_argument("--cprofile", default=None, help="write cProfile's 40 costliest functions (own time) and 60 by "
                    "cumulative time of the run at --concurrency here (where the host's share of a step goes; the timings then carry its cost)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--no-warm-up", action="store_true", help="load the engine without its warm-up and GC freeze "
                    "(runtime/serve/warmup.py): the first batched steps pay the first-use costs, as before")
    a = ap.parse_args(argv)
    if a.llama_batched_bench and not a.gguf:
        ap.error("--llama-batched-bench needs --gguf")
    try:
        ngls = [int(n) for n in a.ngl.split(",")]
    except ValueError:
        ap.error(f"--ngl expected integers separated by commas, found {a.ngl!r}")

    from helmc.runtime.serve.load import load_engine
    t = time.perf_counter()
    plan = None
    if a.profile:
        from helmc.planner.replan_bundle import replan_bundle
        plan = replan_bundle(a.bundle, a.profile)[0]
    engine, _ = load_engine(a.bundle, a.concurrency, weights_dir=a.weights, quiet=False, plan=plan,
                            warm_up=not a.no_warm_up)
    print(f"loaded {a.bundle} in {time.perf_counter() - t:.1f} s: plan {engine.model.session.plan.describe()}, "
          f"max batch {engine.model.max_batch}, context {engine.model.max_context}", file=sys.stderr)
    time_cpu_stage(engine.model)
    rng = np.random.default_rng(a.seed)
    vocab = engine.model.spec.vocab_size
    prompts = [[int(x) for x in rng.integers(1, min(vocab, 32000), size=a.prompt_len)] for _ in range(a.concurrency)]
    run_requests(engine, prompts[:1], 8, "warm")                     # first-call costs out of the timings
    one_steps: list[dict] = []
    singles = [run_requests(engine, [p], a.new_tokens, f"one{i}", one_steps)[0] for i, p in enumerate(prompts)]
    rate1 = [decode_rate([r]) for r in singles]
    steps: list[dict] = []
    if a.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        together = prof.runcall(run_requests, engine, prompts, a.new_tokens, "all", steps)
        with open(a.cprofile, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
    else:
        together = run_requests(engine, prompts, a.new_tokens, "all", steps)
    rate_n, steps_n, e2e_n = decode_rate(together), decode_steps_rate(steps, a.concurrency), end_to_end_rate(together)
    equal = [s["tokens"] == b["tokens"] for s, b in zip(singles, together)]
    first_diff = [next((j for j, (x, y) in enumerate(zip(s["tokens"], b["tokens"])) if x != y), None)
                  for s, b in zip(singles, together)]
    report = {"bundle": os.path.abspath(a.bundle), "concurrency": a.concurrency, "prompt_len": a.prompt_len,
              "warm_up": not a.no_warm_up,
              "new_tokens": a.new_tokens, "replanned_from": a.profile,
              "plan": engine.model.session.plan.describe(), "plan_step_ms": engine.model.session.plan.predictions.t_plan_ms,
              "decode_tok_s_at_1": float(np.median(rate1)),
              f"decode_steps_tok_s_at_{a.concurrency}": steps_n,
              f"decode_tok_s_total_at_{a.concurrency}": rate_n,
              f"end_to_end_tok_s_at_{a.concurrency}": e2e_n,
              f"decode_steps_at_{a.concurrency}": sum(1 for s in steps if s["decoded"] == a.concurrency
                                                      and not s["prefilled"]),
              "batch_speedup": steps_n / float(np.median(rate1)) if rate1 else None,
              "tokens_equal_single": sum(equal), "tokens_first_difference": first_diff,
              "ttft_ms_at_n": [1000 * (r["stamps"][0] - r["t_submit"]) for r in together],
              "ttft_ms_at_1": [1000 * (r["stamps"][0] - r["t_submit"]) for r in singles],
              "step_split_at_1": step_split(one_steps, 1),
              f"step_split_at_{a.concurrency}": step_split(steps, a.concurrency)}
    moe = engine.model.session.gpu_moe()
    if moe is not None:                 # a mixture of experts: the selected (row, expert) pairs served from VRAM
        rows, hits = moe.served(decode=True)
        report["moe_decode_hit_rate"] = hits / rows if rows else None
        report["moe_predicted_hit_rate"] = engine.model.session.plan.predictions.expert_hit_rate
        report["moe_batched_blocks"] = moe.decode_batch.steps if moe.decode_batch is not None else None
    batch_decode = getattr(engine.model.session.gpu, "_batch_decode", None)
    graphs = batch_decode.backend.graphs if batch_decode is not None else None
    report["batch_group_graphs"] = graphs.stats() if graphs is not None else None     # hybrid/batch_graph.py
    split_n = report[f"step_split_at_{a.concurrency}"]
    if split_n and report["plan_step_ms"]:
        report[f"step_vs_plan_at_{a.concurrency}"] = split_n["step_ms"] / report["plan_step_ms"]   # median step / T_plan
    print(json.dumps(report, indent=2), file=sys.stderr)     # helmc's figures stand even if the peer fails
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    if a.llama_batched_bench:
        from benchmarks.llamacpp_peer import llama_batched_bench
        runs = {}
        for ngl in ngls:
            runs[ngl] = llama_batched_bench(a.llama_batched_bench, a.gguf, ngl, a.prompt_len, a.new_tokens,
                                            (1, a.concurrency), a.threads)
            report[f"serve_decode_ratio_vs_llamacpp_ngl{ngl}"] = \
                steps_n / runs[ngl]["by_batch"][a.concurrency]["decode_tok_s"]
        report["llamacpp_by_ngl"] = runs
        lc = report["llamacpp"] = runs[ngls[0]]
        at_n = lc["by_batch"][a.concurrency]
        report["serve_decode_ratio_vs_llamacpp"] = steps_n / at_n["decode_tok_s"]          # S_TG against S_TG
        report["serve_decode_total_ratio_vs_llamacpp"] = rate_n / at_n["decode_tok_s"]
        report["serve_end_to_end_ratio_vs_llamacpp"] = e2e_n / (
            a.concurrency * at_n["tg"] / (at_n["t_pp_s"] + at_n["t_tg_s"]))
        report["serve_decode_ratio_vs_llamacpp_at_1"] = report["decode_tok_s_at_1"] / lc["by_batch"][1]["decode_tok_s"]
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
