#!/usr/bin/env python3
"""A dense GGUF file under a VRAM budget and on the whole GPU: helmc beside llama.cpp in one run, one command.

    python -m benchmarks.bench_dense_gguf --gguf qwen3-8b-q5_k_m.gguf --bundle qwen3-8b-q5km-3.5g.bundle --budget 3.5 \\
        --profile helmc/hardware/presets/h200-profiled.json --llama-bench /tmp/lc/build/bin/llama-bench --threads 16 \\
        --label 'Qwen3-8B Q5_K_M (random weights)' --out benchmarks/results/h200-qwen3-8b-q5km-3.5gib.json

The bundle is built for the budget (`helmc build GGUF PROFILE --gpu-budget B -o BUNDLE`). Two cases:
- `within_budget`: the bundle's plan for the budget (made again from --profile, as `helmc plan` does), against
  llama.cpp's fastest `-ngl` whose measured peak VRAM fits the budget (`--llama-ngl auto`: the -ngl values around
  the largest that fits are searched, llamacpp_peer.ngl_search);
- `all_gpu`: the same bundle planned for the whole GPU, against llama.cpp's `-ngl 99`.
benchmarks.bench_decode measures the warm figures (median of --requests after a warm-up request of the same
length; peak VRAM; llama-bench's runs) and writes --out; then each case's plan runs as a user runs it, `helmc run
--plan PLAN --prompt-ids ... --json` in a fresh process (--oneshot-runs times: load, warm-up and the request, the
same prompt). Each case in the report's `cases` has helmc's warm and one-shot decode tok/s, llama.cpp's run it is
compared with, `decode_ratio_vs_llamacpp` (helmc's warm decode over llama.cpp's), the one-shot ratios, the target
(1.3 within the budget, 1.1 on the whole GPU) and whether it is met. The report keeps bench_decode's rows, so
`python -m benchmarks.make_table` writes its table rows from it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import bench_decode

TARGETS = {"within_budget": 1.3, "all_gpu": 1.1}


def one_shot(bundle: str, weights: str, plan_path: str, prompt: list[int], new_tokens: int) -> dict:
    """`helmc run --json` in a fresh process: its TTFT and decode tok/s as it reports them."""
    cmd = [sys.executable, "-m", "helmc.cli.main", "run", bundle, "--weights", weights, "--plan", plan_path,
           "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(new_tokens), "--json"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ttft_ms": r.get("ttft_ms"), "decode_tok_s": r.get("decode_tok_s"), "tokens": len(r.get("tokens", [])),
            "stop_reason": r.get("stop_reason")}


def case_plan(bundle: str, profile: str, all_gpu: bool):
    """The plan bench_decode ran the case with: the bundle's own budget, or the profile's whole GPU."""
    from helmc.hardware.profile import HardwareProfile
    from helmc.planner.replan_bundle import replan_bundle
    hw = HardwareProfile.load(profile)
    return replan_bundle(bundle, hw, gpu_budget_gib=hw.gpu.vram_total_bytes / 2**30 if all_gpu else None)[0]


def peer_of(case: str, row: dict, llama: list[dict]) -> dict | None:
    """llama.cpp's run a case is compared with: the fastest within the row's budget, or -ngl 99."""
    if case == "all_gpu":
        return next((r for r in llama if r["ngl"] == 99), None)
    ngl = row.get("llamacpp_ngl_within_budget")
    return next((r for r in llama if r["ngl"] == ngl), None) if ngl is not None else None


def case_fields(case: str, row: dict, llama: list[dict], oneshot: list[dict]) -> dict:
    peer = peer_of(case, row, llama)
    runs = [r["decode_tok_s"] for r in oneshot if r.get("decode_tok_s")]
    out = {"plan": row["plan"], "gpu_budget_gib": row.get("gpu_budget_gib"), "peak_vram_gib": row.get("peak_vram_gib"),
           "helmc_within_budget": row.get("helmc_within_budget"),
           "helmc_decode_tok_s": row["decode_tok_s_p50"], "helmc_ttft_ms": row["ttft_ms_p50"],
           "oneshot": oneshot, "llamacpp_ngl": None if peer is None else peer["ngl"],
           "llamacpp_decode_tok_s": None if peer is None else peer["decode_tok_s_p50"],
           "llamacpp_peak_vram_gib": None if peer is None else peer.get("peak_vram_gib"),
           "target": TARGETS[case]}
    if peer is not None:
        out["decode_ratio_vs_llamacpp"] = row["decode_tok_s_p50"] / peer["decode_tok_s_p50"]
        out["oneshot_decode_ratio_vs_llamacpp"] = [round(v / peer["decode_tok_s_p50"], 3) for v in runs]
        out["meets_target"] = out["decode_ratio_vs_llamacpp"] >= TARGETS[case]
    out["oneshot_decode_ratio_vs_warm"] = [round(v / row["decode_tok_s_p50"], 3) for v in runs]
    return out


def arguments(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file both run (benchmarks.make_gguf makes random ones)")
    ap.add_argument("--bundle", required=True, help="helmc's bundle of it, built with --gpu-budget BUDGET")
    ap.add_argument("--budget", type=float, required=True, help="GiB of VRAM: the bundle's budget and llama.cpp's")
    ap.add_argument("--profile", required=True, help="the hardware profile the plans are made from (hardware.json)")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (none: helmc alone)")
    ap.add_argument("--llama-ngl", default="auto", help="auto (searched within --budget, and 99), or -ngl values")
    ap.add_argument("--llama-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="llama-bench threads")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--oneshot-runs", type=int, default=2, help="fresh `helmc run` processes per case (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", required=True, help="what the model is, for make_table")
    ap.add_argument("--out", required=True, help="the JSON report (bench_decode's, with `cases`)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = arguments(argv)
    for what, path in (("--gguf", a.gguf), ("--bundle", a.bundle), ("--profile", a.profile)):
        if not os.path.exists(path):
            print(f"bench_dense_gguf {what}: expected an existing path, found none at {path}", file=sys.stderr)
            return 2
    decode = ["--model", a.gguf, "--bundle", a.bundle, "--replan", "--profile", a.profile, "--variants", "all_gpu",
              "--gpu-budget", str(a.budget), "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
              "--requests", str(a.requests), "--seed", str(a.seed), "--skip", "accelerate,hf_gpu",
              "--label", a.label, "--out", a.out]
    if a.llama_bench:
        decode += ["--llama-bench", a.llama_bench, "--llama-ngl", a.llama_ngl, "--llama-reps", str(a.llama_reps)]
        decode += ["--threads", str(a.threads)] if a.threads else []
    bench_decode.main(decode)
    with open(a.out) as f:
        report = json.load(f)
    report["command"] = "python -m benchmarks.bench_dense_gguf " + " ".join(argv)
    from helmc.model.load import load_spec
    prompt = np.random.default_rng(a.seed).integers(3, load_spec(a.gguf).vocab_size, a.prompt_len).tolist()
    report["cases"] = {}
    for row in report["helmc"]:
        case = "all_gpu" if row.get("variant") == "all_gpu" else "within_budget"
        with tempfile.TemporaryDirectory() as tmp:
            plan_path = os.path.join(tmp, "plan.json")
            with open(plan_path, "w") as f:
                f.write(case_plan(a.bundle, a.profile, case == "all_gpu").to_json() + "\n")
            oneshot = [one_shot(a.bundle, a.gguf, plan_path, prompt, a.new_tokens) for _ in range(a.oneshot_runs)]
        report["cases"][case] = c = case_fields(case, row, report.get("llamacpp", []), oneshot)
        row["decode_ratio_vs_llamacpp"], row["llamacpp_ngl_compared"] = c.get("decode_ratio_vs_llamacpp"), c["llamacpp_ngl"]
        bench_decode.log(f"{case}: helmc {c['helmc_decode_tok_s']:.2f} tok/s warm, one-shot {c['oneshot']}; llama.cpp "
                         f"-ngl {c['llamacpp_ngl']} {c['llamacpp_decode_tok_s']}; decode_ratio_vs_llamacpp "
                         f"{c.get('decode_ratio_vs_llamacpp')} (target {c['target']})")
    with open(a.out + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
