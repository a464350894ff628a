"""8 concurrent streaming requests through `helmc serve` on a mixture-of-experts bundle, beside llama.cpp's
llama-batched-bench at 8 sequences under the same VRAM budget, in one run on the GPU machine.

    python -m benchmarks.bench_moe_serve BUNDLE --gguf Qwen3-30B-A3B-Q4_K.gguf --budget-gib 8 \
        --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --ncmoe 48,40,32,24 --ot-exps \
        --concurrency 8 --prompt-len 128 --new-tokens 128 --label "Qwen3-30B-A3B Q4_K (random weights)" \
        --out benchmarks/results/h200-qwen3-30b-a3b-q4k-serve.json

helmc: `helmc serve BUNDLE` started as its own process (the real server), --concurrency requests of --prompt-len
random token ids submitted at once by the openai client (`completions.create(stream=True)`, greedy, ignore_eos:
every request makes exactly --new-tokens tokens), after one warm-up round of the same shape with 8 new tokens. The
BUNDLE is built for the budget and the batch: `helmc build GGUF --gpu-budget 8GiB --max-batch 8`.
  decode_tok_s_at_N   every request's tokens after its first, from the last first token to the last token: the
                      steps where all N decode (bench_serve's decode_tok_s_total_at_N);
  end_to_end_tok_s_at_N  all N x --new-tokens tokens from the submission to the last token, prefills included;
  moe_decode_hit_rate   of the timed round's decode rows, the share of selected experts VRAM served (the server's
                        /metrics: helmc_moe_decode_vram_hits over helmc_moe_decode_expert_selections).
Peak VRAM of both is sampled with nvidia-smi over each run, less what was in use before it.
llama.cpp: `llama-batched-bench -m GGUF -ngl 99 -npp P -ntg T -npl N` with `-ncmoe K` for each K given and with
`-ot exps=CPU`; its S_TG at N is the decode figure. moe_serve_ratio_vs_llamacpp = helmc's decode_tok_s_at_N over the
fastest llama.cpp run whose peak VRAM fits --budget-gib (the issue's aim: >= 1.2).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time

from benchmarks.llamacpp_peer import llama_batched_bench
from benchmarks.peak_vram import smi_peak_vram
from benchmarks.serve_load import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def start_server(a, log_path: str):
    """`helmc serve BUNDLE` on a free port; (process, base URL) once it listens."""
    cmd = [sys.executable, "-m", "helmc.cli.main", "serve", a.bundle, "--port", "0", "--model-name", "m",
           "--max-batch", str(a.concurrency)]
    if a.weights:
        cmd += ["--weights", a.weights]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=child_env(), stderr=log, stdout=subprocess.DEVNULL)
    t0 = time.time()
    while True:
        text = open(log_path).read()
        if "listening on " in text:
            return proc, text.split("listening on ")[1].split()[0]
        if proc.poll() is not None or time.time() - t0 > 900:
            proc.kill()
            sys.exit(f"bench_moe_serve: helmc serve did not start: {text[-1000:]}")
        time.sleep(0.5)


async def one_request(client, prompt: list[int], new_tokens: int) -> dict:
    rec = {"t_submit": time.perf_counter(), "stamps": [], "tokens": None}
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            rec["stamps"].append(time.perf_counter())
        if chunk.usage is not None:
            rec["tokens"] = chunk.usage.completion_tokens
    return rec


async def round_of(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    from openai import AsyncOpenAI
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=1800, max_retries=0) as client:
        return await asyncio.gather(*(one_request(client, p, new_tokens) for p in prompts))


def rates(recs: list[dict], new_tokens: int) -> dict:
    n = len(recs)
    bad = [r["tokens"] for r in recs if r["tokens"] != new_tokens]
    if bad:
        raise RuntimeError(f"expected {new_tokens} tokens per request (ignore_eos), got {bad}")
    t0 = min(r["t_submit"] for r in recs)
    end = max(r["stamps"][-1] for r in recs)
    # the decode window opens when the last prompt's first text came; a stream whose text the detokenizer held to
    # its end (a random model's partial UTF-8 byte tokens: no chunk until then) does not say when its decode began
    # (then the window is the whole round, its prompts included, and the first tokens' time is unknown: None)
    streamed = [r["stamps"][0] for r in recs if len(r["stamps"]) > 1]
    last_first = max(streamed) if streamed else t0
    return {f"decode_tok_s_at_{n}": n * (new_tokens - 1) / (end - last_first),
            f"end_to_end_tok_s_at_{n}": n * new_tokens / (end - t0),
            "ttft_ms_max": 1000 * (last_first - t0) if streamed else None,
            "decode_window": "from the last first token" if streamed else "the whole round", "wall_s": end - t0}


def bench_helmc(a) -> dict:
    import numpy as np
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, 30000, a.prompt_len)] for _ in range(a.concurrency)]
    log_path = os.path.join(a.log_dir, "helmc-serve.log")
    # sampled from before the server starts: its whole VRAM (context, weights, KV, pools), as llama.cpp's is
    with smi_peak_vram() as vram:
        proc, url = start_server(a, log_path)
        try:
            asyncio.run(round_of(url, prompts, 8))                  # warm-up: graphs, KV pages, first calls
            before = moe_counts(url)
            recs = asyncio.run(round_of(url, prompts, a.new_tokens))
            after = moe_counts(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    out = {"system": "helmc serve", "bundle": a.bundle, "concurrency": a.concurrency, **rates(recs, a.new_tokens),
           "peak_vram_gib": vram.held_gib}
    if before is not None and after is not None and after[0] > before[0]:     # the timed round's decode rows
        out["moe_decode_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
    plan = os.path.join(a.bundle, "plan.json")
    if os.path.isfile(plan):
        from helmc.runtime.bundle.plan import Plan
        with open(plan) as f:
            gpu_bytes = Plan.from_json(f.read()).memory.gpu_bytes
        out["plan_gpu_bytes"] = gpu_bytes                         # what the plan holds in VRAM: within the budget
        out["plan_gpu_gib"] = gpu_bytes / 2 ** 30 if gpu_bytes else None
    print(f"helmc serve: {out[f'decode_tok_s_at_{a.concurrency}']:.1f} tok/s decode at {a.concurrency}, "
          f"{out[f'end_to_end_tok_s_at_{a.concurrency}']:.1f} end to end", file=sys.stderr)
    return out


def moe_counts(url: str) -> tuple[float, float] | None:
    """(decode expert selections, VRAM hits) from the server's /metrics, or None (not a MoE on a GPU stage)."""
    import urllib.request
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("helmc_moe_decode_expert_selections", "helmc_moe_decode_vram_hits"):
            values[name] = float(value)
    if len(values) < 2:
        return None
    return values["helmc_moe_decode_expert_selections"], values["helmc_moe_decode_vram_hits"]


def llama_configs(a) -> list[tuple[str, tuple[str, ...]]]:
    out = [(f"ncmoe{k}", ("-ncmoe", str(k))) for k in (int(x) for x in a.ncmoe.split(",") if x)]
    if a.ot_exps:
        out.append(("ot_exps_cpu", ("-ot", "exps=CPU")))
    return out


def bench_llama(a) -> list[dict]:
    rows = []
    for name, extra in llama_configs(a):
        r = llama_batched_bench(a.llama_batched_bench, a.gguf, 99, a.prompt_len, a.new_tokens,
                                parallel=(a.concurrency,), threads=a.threads, extra=extra)
        r["config"] = name
        r[f"decode_tok_s_at_{a.concurrency}"] = r["by_batch"][a.concurrency]["decode_tok_s"]
        print(f"llama.cpp {name}: S_TG {r[f'decode_tok_s_at_{a.concurrency}']:.1f} tok/s at {a.concurrency}, "
              f"peak VRAM {r['peak_vram_gib']}", file=sys.stderr)
        rows.append(r)
    return rows


def ratio(report: dict, a) -> dict:
    key = f"decode_tok_s_at_{a.concurrency}"
    fits = [r for r in report["llamacpp"] if r.get("peak_vram_gib") is not None and r["peak_vram_gib"] <= a.budget_gib]
    if not fits or "helmc" not in report:
        return {}
    best = max(fits, key=lambda r: r[key])
    held = report["helmc"].get("peak_vram_gib")
    return {"llamacpp_fastest_within_budget": best["config"], "llamacpp_decode_tok_s_within_budget": best[key],
            "helmc_within_budget": None if held is None else held <= a.budget_gib,
            "moe_serve_ratio_vs_llamacpp": report["helmc"][key] / best[key]}


def device_name() -> str:
    """GPU 0's name as nvidia-smi gives it ("?" without one): this process starts no CUDA context of its own."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", help="a helmc bundle of the MoE model built for --budget-gib and --concurrency")
    ap.add_argument("--weights", default=None,
                    help="the bundle's weights where they are not beside it (serve --weights)")
    ap.add_argument("--gguf", default=None, help="the same model as a GGUF file for llama.cpp")
    ap.add_argument("--llama-batched-bench", default=None, help="llama.cpp's binary (no llama.cpp rows without)")
    ap.add_argument("--ncmoe", default="48,40,32,24", help="comma-separated -ncmoe values, each with -ngl 99")
    ap.add_argument("--ot-exps", action="store_true", help="also run -ngl 99 -ot exps=CPU")
    ap.add_argument("--budget-gib", type=float, required=True, help="the VRAM budget both systems are held to")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: its own)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.llama_batched_bench and not a.gguf:
        ap.error("--llama-batched-bench needs --gguf")
    report = {"label": a.label, "device": device_name(), "threads": a.threads,
              "command": "python -m benchmarks.bench_moe_serve " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
              "budget_gib": a.budget_gib, "concurrency": a.concurrency, "prompt_len": a.prompt_len,
              "new_tokens": a.new_tokens, "llamacpp": []}

    def save():
        report.update(ratio(report, a))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=2)

    report["helmc"] = bench_helmc(a)
    save()
    if a.llama_batched_bench:
        for r in bench_llama(a):
            report["llamacpp"].append(r)
            save()
    print(json.dumps({k: v for k, v in report.items() if k not in ("llamacpp",)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
