"""Mixture-of-experts decode and prefill on the GPU machine: helmc beside llama.cpp in one run, on one GGUF file.

    python -m benchmarks.bench_moe --gguf Qwen3-30B-A3B-Q4_K.gguf --bundle moe-4g.bundle --bundle moe-8g.bundle \
        --bundle moe-gpu.bundle --llama-bench llama-bench --ncmoe 48,40,32,24,16 --ot-exps --budgets 4,8 \
        --prompt-len 128 --new-tokens 64 --ttft-prompt 2048 --label "Qwen3-30B-A3B Q4_K (random weights)" \
        --out benchmarks/results/h200-qwen3-30b-a3b-q4k.json

llama.cpp runs with every layer on the GPU (`-ngl 99`) and the experts of its first N blocks on the CPU
(`-ncmoe N`, each N given), with all experts on the CPU (`-ot exps=CPU`), and all on the GPU; each run's peak VRAM is
sampled with nvidia-smi. Per VRAM budget, helmc's bundle made for that budget is compared with llama.cpp's fastest run
whose peak VRAM fits the same budget. Decode: a prompt of --prompt-len tokens, --new-tokens greedy tokens, the median
of --requests requests after one warm-up request of the same size (llama-bench times its generation after a warm-up
too). TTFT: a --ttft-prompt-token prompt, its first token, median of two after one warm-up; llama.cpp's is the prompt
length over its prompt rate. The roofline of a helmc row: the bytes a token reads where they lie (the non-expert
weights and the VRAM-resident experts' share at the GPU's HBM copy rate, the host-resident experts' share at the host's
read rate, both measured in this run), one after the other.

Two inputs (benchmarks/README.md, "Mixture-of-experts inputs"): llama.cpp's peer file (`mkgguf.py --config 30b-a3b
--type q4_k`), the comparison's, whose random blocks send nearly every token to the same few experts of a block (a
hit rate and a prompt time no real model gets); and `python -m benchmarks.make_gguf FILE --config qwen3-30b-a3b --mix
q4_k_m`, whose prompts spread over nearly all 128 experts of every block, as a trained router's do: the same rows
without that flattery.

JSON (`--out`, rewritten after each system): `llamacpp` rows, `helmc` rows (decode_tok_s_p50, ttft_ms_p50 at the long
prompt, peak_vram_gib, gpu_budget_gib, plan, t_plan_ms, measured_over_plan, experts_in_vram, predicted_hit_rate,
measured_hit_rate, expert_cache_hit_rate (the decode requests' share of selected experts served from VRAM, the VRAM
expert cache on or off as `expert_cache` says), decode_fraction_of_roofline), and the named ratios: `moe_decode_ratio_vs_llamacpp_{B}gib` per budget,
`moe_prefill_ratio_vs_llamacpp` (helmc's TTFT over llama.cpp's within the smallest budget: the aim is <= 0.5),
`moe_all_gpu_ratio_vs_llamacpp`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

from benchmarks.bench_context import free_device_pools
from benchmarks.bench_decode import log, measure_bandwidths
from benchmarks.llamacpp_peer import fastest_within, llama_bench
from benchmarks.peak_vram import PeakVram, cuda_used_bytes, gpu_memory_used_mib

GB = 1e9


# ---- llama.cpp ----------------------------------------------------------------------------------
def llama_configs(a) -> list[tuple[str, tuple[str, ...]]]:
    """(name, llama-bench's extra arguments) of each llama.cpp placement to run, all with -ngl 99."""
    out = [(f"ncmoe{n}", ("-ncmoe", str(n))) for n in (int(x) for x in a.ncmoe.split(",") if x)]
    if a.ot_exps:
        out.append(("ot_exps_cpu", ("-ot", "exps=CPU")))
    if not a.skip_llama_all_gpu:
        out.append(("all_gpu", ()))
    return out


def run_llama(a, name: str, extra: tuple[str, ...]) -> dict:
    r = llama_bench(a.llama_bench, a.gguf, 99, a.ttft_prompt, a.new_tokens, reps=a.llama_reps, threads=a.threads,
                    extra=extra)
    r["config"] = name
    log(f"llama.cpp {name}: decode {r['decode_tok_s_p50']:.2f} tok/s, pp{a.ttft_prompt} {r['prompt_tok_s']:.0f} tok/s "
        f"(TTFT {r['ttft_ms_p50']:.0f} ms), peak VRAM {r['peak_vram_gib']}")
    return r


# ---- helmc --------------------------------------------------------------------------------------
def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(10, min(vocab, 30000), n)]


def moe_bytes_per_token(session) -> tuple[float, float]:
    """(bytes a decode token reads from VRAM, from host RAM) on average under the session's plan: the non-expert
    weights whole, each block's experts by top_k / num_experts, split by the plan's VRAM-resident experts."""
    spec, plan, ck = session.spec, session.plan, session.checkpoint
    moe = spec.moe
    expert_bytes, other = [0] * spec.num_layers, 0
    for name in ck.names():
        info = ck.info(name)
        layer = _layer_of(info.gguf_name)
        if layer is not None and "_exps" in info.gguf_name:
            expert_bytes[layer] += info.nbytes
        elif info.gguf_name != "token_embd.weight":      # the embedding is a gather of one row, not a read
            other += info.nbytes
    share = moe.top_k / moe.num_experts
    gpu, host = float(other), 0.0
    for i, b in enumerate(expert_bytes):
        on_gpu = len(plan.placement.gpu_experts[i]) / moe.num_experts if plan.placement.gpu_experts else 0.0
        gpu += b * share * on_gpu
        host += b * share * (1 - on_gpu)
    return gpu, host


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "blk") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _with_expert_cache(bundle: str, mode: str):
    """The bundle's plan with the VRAM expert cache turned on or off (--expert-cache), or None: the plan's own."""
    if mode == "plan":
        return None
    from helmc.runtime.bundle.plan import Plan
    with open(os.path.join(bundle, "plan.json")) as f:
        return Plan.from_json(f.read()).replace(expert_cache=mode == "on")


def bench_helmc(a, bundle: str, bw: dict) -> dict:
    import torch

    from helmc.runtime.session import Session

    baseline = gpu_memory_used_mib()
    vram = PeakVram(cuda_used_bytes(torch.cuda.mem_get_info), (baseline or 0) * 2 ** 20)
    with vram:
        t = time.perf_counter()
        s = Session.load(bundle, weights_dir=a.gguf, plan=_with_expert_cache(bundle, a.expert_cache))
        load_s = time.perf_counter() - t
        plan = s.plan
        log(f"helmc {bundle}: loaded in {load_s:.1f} s, plan {plan.describe()}, T_plan {plan.predictions.t_plan_ms:.2f} ms")
        short = prompt_ids(a.prompt_len, s.spec.vocab_size, 1)
        long = prompt_ids(a.ttft_prompt, s.spec.vocab_size, 2)
        s.generate(prompt_ids=short, max_new_tokens=a.new_tokens, temperature=0.0, stop_at_eos=False)
        runs = []
        for i in range(a.requests):
            r = s.generate(prompt_ids=short, max_new_tokens=a.new_tokens, temperature=0.0, stop_at_eos=False)
            runs.append(r)
            log(f"  request {i}: TTFT {r.ttft_ms:.1f} ms, {r.decode_tok_s:.2f} tok/s")
        s.generate(prompt_ids=long, max_new_tokens=1, temperature=0.0, stop_at_eos=False)
        ttfts = [s.generate(prompt_ids=long, max_new_tokens=1, temperature=0.0, stop_at_eos=False).ttft_ms
                 for _ in range(2)]
        log(f"  TTFT of {a.ttft_prompt} tokens: {ttfts}")
    decode = statistics.median(r.decode_tok_s for r in runs)
    per_token = statistics.median(statistics.median(r.per_token_ms) for r in runs)
    gpu_b, host_b = moe_bytes_per_token(s)
    roof_ms = 1e3 * (gpu_b / (bw["hbm_copy_gbs"] * GB) + host_b / (bw["host_read_gbs"] * GB))
    E = s.spec.moe.num_experts
    in_vram = sum(len(x) for x in plan.placement.gpu_experts) if plan.placement.gpu_experts else 0
    out = {"bundle": bundle, "load_s": load_s, "plan": plan.describe(), "t_plan_ms": plan.predictions.t_plan_ms,
           "decode_tok_s_p50": decode, "per_token_ms_p50": per_token, "short_prompt_ttft_ms_p50":
           statistics.median(r.ttft_ms for r in runs), "ttft_ms_p50": statistics.median(ttfts),
           "ttft_prompt_len": a.ttft_prompt, "peak_vram_gib": vram.peak_gib,
           "gpu_budget_gib": round(plan.memory.usable_vram_bytes / 2 ** 30, 3) if plan.memory.usable_vram_bytes else None,
           "measured_over_plan": per_token / plan.predictions.t_plan_ms if plan.predictions.t_plan_ms else None,
           "experts_in_vram": in_vram, "experts_total": E * s.spec.num_layers,
           # the plan's (from routing statistics where the bundle has them); a plan made before it: the share held
           "predicted_hit_rate": plan.predictions.expert_hit_rate or in_vram / (E * s.spec.num_layers),
           "bytes_per_token_gpu": gpu_b, "bytes_per_token_host": host_b, "roofline_ms": roof_ms,
           "decode_fraction_of_roofline": roof_ms / per_token, "tokens_first_request": list(runs[0].tokens)}
    moe = s.gpu_moe()
    if moe is not None:                  # selected (token, expert) pairs served from VRAM, over every request
        out["measured_hit_rate"] = moe.hit_rate()
        # the decode requests' share (the VRAM expert cache's slots as they moved), beside predicted_hit_rate
        out["expert_cache"] = plan.placement.expert_cache
        out["expert_cache_hit_rate"] = statistics.median(r.experts["expert_cache_hit_rate"] for r in runs)
        out["expert_cache_promotions"] = moe.cache_promotions()
    del s
    return out


# ---- the comparison -----------------------------------------------------------------------------
def ratios(report: dict, budgets: list[float]) -> dict:
    """The named ratios: per budget helmc's bundle for it against llama.cpp's fastest run within it."""
    llama, helmc = report["llamacpp"], report["helmc"]
    out = {}
    smallest = None
    for b in budgets:
        row = next((h for h in helmc if h.get("gpu_budget_gib") is not None and abs(h["gpu_budget_gib"] - b) < 0.26),
                   None)
        peer = fastest_within(llama, b)
        key = f"{b:g}gib"
        out[f"llamacpp_config_within_{key}"] = None if peer is None else peer["config"]
        out[f"llamacpp_decode_tok_s_within_{key}"] = None if peer is None else peer["decode_tok_s_p50"]
        if row is None or peer is None:
            out[f"moe_decode_ratio_vs_llamacpp_{key}"] = None
            continue
        out[f"helmc_within_{key}"] = row["peak_vram_gib"] is not None and row["peak_vram_gib"] <= b
        out[f"moe_decode_ratio_vs_llamacpp_{key}"] = row["decode_tok_s_p50"] / peer["decode_tok_s_p50"]
        if smallest is None:
            smallest = b
            out["moe_prefill_ratio_vs_llamacpp"] = row["ttft_ms_p50"] / peer["ttft_ms_p50"]
            out["moe_prefill_budget_gib"] = b
    # helmc on the whole GPU: the bundle whose plan holds every expert in VRAM (or was made without a budget).
    full = next((h for h in helmc if h["experts_in_vram"] == h["experts_total"] or h["gpu_budget_gib"] is None), None)
    peer = next((r for r in llama if r["config"] == "all_gpu"), None)
    if full is not None and peer is not None:
        out["moe_all_gpu_ratio_vs_llamacpp"] = full["decode_tok_s_p50"] / peer["decode_tok_s_p50"]
    return out


def table(report: dict) -> str:
    lines = [f"{'system':<34} {'decode tok/s':>12} {'TTFT ms':>9} {'VRAM GiB':>9}"]
    for r in report["llamacpp"]:
        lines.append(f"{'llama.cpp ' + r['config']:<34} {r['decode_tok_s_p50']:>12.2f} {r['ttft_ms_p50']:>9.0f} "
                     f"{(r['peak_vram_gib'] or float('nan')):>9.2f}")
    for r in report["helmc"]:
        lines.append(f"{'helmc ' + os.path.basename(r['bundle'].rstrip('/')):<34} {r['decode_tok_s_p50']:>12.2f} "
                     f"{r['ttft_ms_p50']:>9.0f} {(r['peak_vram_gib'] or float('nan')):>9.2f}")
    for k, v in report.get("ratios", {}).items():
        lines.append(f"{k}: {v if not isinstance(v, float) else round(v, 3)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="the MoE model as a GGUF file (both systems run it)")
    ap.add_argument("--bundle", action="append", default=[], help="helmc bundle built from --gguf (repeatable)")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (no llama.cpp rows without)")
    ap.add_argument("--ncmoe", default="48,40,32,24,16,8", help="comma-separated -ncmoe values, each with -ngl 99")
    ap.add_argument("--ot-exps", action="store_true", help="also run -ngl 99 -ot exps=CPU")
    ap.add_argument("--skip-llama-all-gpu", action="store_true")
    ap.add_argument("--budgets", default="4,8", help="comma-separated VRAM budgets in GiB to compare within")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ttft-prompt", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--llama-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--expert-cache", choices=("plan", "on", "off"), default="plan",
                    help="the VRAM expert cache as each bundle's plan says, or on / off for every bundle")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--llama-json", default=None,
                    help="take the llama.cpp rows from an earlier bench_moe JSON of the same GGUF (its command and "
                         "device kept beside them) instead of running llama-bench")
    a = ap.parse_args(argv)
    budgets = [float(b) for b in a.budgets.split(",") if b]
    import torch

    report = {"label": a.label or os.path.basename(a.gguf), "model": a.gguf, "device": torch.cuda.get_device_name(0),
              "command": "python -m benchmarks.bench_moe " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
              "budgets_gib": budgets, "llamacpp": [], "helmc": []}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=2)
    report["bandwidth"] = measure_bandwidths()
    log(f"bandwidths: {report['bandwidth']}")
    for bundle in a.bundle:
        free_device_pools()           # an earlier bundle's pooled memory would count in this one's baseline
        report["helmc"].append(bench_helmc(a, bundle, report["bandwidth"]))
        save()
    if a.llama_json:
        with open(a.llama_json) as f:
            earlier = json.load(f)
        if os.path.basename(earlier["model"]) != os.path.basename(a.gguf) or not earlier["llamacpp"]:
            raise SystemExit(f"--llama-json: expected llama.cpp rows of {os.path.basename(a.gguf)}, found "
                             f"{len(earlier['llamacpp'])} rows of {os.path.basename(earlier['model'])}")
        report.update(llamacpp=earlier["llamacpp"], llamacpp_command=earlier["command"],
                      llamacpp_device=earlier["device"])
    elif a.llama_bench:
        for name, extra in llama_configs(a):
            try:
                report["llamacpp"].append(run_llama(a, name, extra))
            except RuntimeError as e:
                log(f"llama.cpp {name}: {str(e)[-300:]}")
            save()
    report["ratios"] = ratios(report, budgets)
    save()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
