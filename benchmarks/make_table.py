"""Write benchmarks/RESULTS.md, the one results table, from the JSON files bench_decode writes.

    python -m benchmarks.make_table [--results benchmarks/results] [--out benchmarks/RESULTS.md] [--check]

One row per helmc bundle run (a hybrid, its plain split, the whole GPU) of every benchmarks/results/*.json: the
model, the GPU memory budget, the machine, helmc's decode tok/s, llama.cpp's decode tok/s at the largest `-ngl` that
fits in the same budget, and their ratio. --check exits 1 when RESULTS.md is not what the JSON files give.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = ("| model | GPU budget | placement | machine | helmc tok/s | llama.cpp tok/s (`-ngl`) | helmc / llama.cpp |\n"
          "| --- | --- | --- | --- | ---: | ---: | ---: |")


def placement(row: dict) -> str:
    """What ran where, in words: all on the GPU, a CPU/GPU split, or a hybrid decode."""
    if row.get("cpu_units") in (0, "0") or str(row.get("plan", "")).startswith("cuda("):
        return "all on the GPU"
    if row.get("hybrid"):
        return f"hybrid: CPU + {row.get('streamed_blocks', '?')} blocks streamed to the GPU"
    return "CPU/GPU split"


def rows(report: dict) -> list[dict]:
    """The table's rows of one bench_decode report: each helmc row beside the llama.cpp run in its budget."""
    peers = {str(p["ngl"]): p for p in report.get("llamacpp", [])}
    machine = report.get("device", "?")
    threads = report.get("bandwidth", {}).get("threads")
    if threads:
        machine += f", {threads} CPU threads"
    out = []
    for row in report.get("helmc", []):
        # bench_dense_gguf's rows name the run they are compared with (the all-GPU case: -ngl 99)
        ngl = row.get("llamacpp_ngl_compared", row.get("llamacpp_ngl_within_budget"))
        peer = peers.get(str(ngl))
        ratio = row.get("decode_ratio_vs_llamacpp", row.get("decode_ratio_vs_llamacpp_within_budget"))
        budget = row.get("gpu_budget_gib", report.get("gpu_budget_gib"))
        out.append({"model": report.get("label") or os.path.basename(str(report.get("model", "?"))),
                    "budget": "whole GPU" if row.get("variant") == "all_gpu" else f"{float(budget):g} GiB",
                    "placement": placement(row), "machine": machine,
                    "helmc": row["decode_tok_s_p50"],
                    "llamacpp": None if peer is None else peer["decode_tok_s_p50"], "ngl": ngl,
                    "ratio": ratio, "command": report.get("command", "")})
    return out


def fmt(x, digits: int) -> str:
    return "-" if x is None else f"{float(x):.{digits}f}"


def table(results_dir: str) -> str:
    paths = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    lines = ["# Benchmark results", "",
             "Written by `python -m benchmarks.make_table` from `benchmarks/results/*.json` (do not edit by hand).",
             "Decode speed of one request (prompt 128 tokens, 64 new tokens, median of the requests), helmc beside",
             "llama.cpp's `llama-bench` on the same weights and machine, with llama.cpp given as many layers on the GPU",
             "as fit in the same GPU memory budget. `helmc / llama.cpp` is helmc's tok/s divided by llama.cpp's:",
             "above 1 helmc is faster.", "", HEADER]
    commands = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for r in rows(report):
            ngl = "" if r["ngl"] is None else f" ({r['ngl']})"
            lines.append(f"| {r['model']} | {r['budget']} | {r['placement']} | {r['machine']} | {fmt(r['helmc'], 1)} | "
                         f"{fmt(r['llamacpp'], 1)}{ngl} | {fmt(r['ratio'], 2)} |")
        if report.get("command"):
            commands.append(f"- `{os.path.basename(path)}`: `{report['command']}`")
    lines += moe_section(os.path.join(results_dir, "moe"))
    lines += serve_section(os.path.join(results_dir, "moe_serve"))
    lines += ["", "Commands (each writes the JSON file named):", ""] + commands
    return "\n".join(lines) + "\n"


MOE_HEADER = ("| model | GPU budget | machine | helmc tok/s | measured / planned ms | experts in VRAM | "
              "hit rate planned / decode | helmc peak VRAM GiB | llama.cpp tok/s (config) | helmc / llama.cpp | "
              "TTFT 2048 helmc / llama.cpp ms |\n"
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def moe_section(folder: str) -> list[str]:
    """The mixture-of-experts rows of results/moe/*.json (benchmarks/bench_moe.py): per helmc bundle, llama.cpp's
    fastest run within the same VRAM (every `-ncmoe N` and `-ot exps=CPU` tried, all with -ngl 99)."""
    paths = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not paths:
        return []
    lines = ["", "Mixtures of experts (`python -m benchmarks.bench_moe`): decode of one request, helmc's plan for each "
             "budget beside llama.cpp's fastest configuration whose measured peak VRAM fits it.", "", MOE_HEADER]
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        machine = f"{report.get('device', '?')}, {report.get('bandwidth', {}).get('threads', '?')} CPU threads"
        for row in report["helmc"]:
            budget = row.get("gpu_budget_gib")
            whole = budget is None or row["experts_in_vram"] == row["experts_total"]
            fits = [r for r in report["llamacpp"] if r.get("peak_vram_gib") is not None
                    and (whole or r["peak_vram_gib"] <= budget)]
            peer = max(fits, key=lambda r: r["decode_tok_s_p50"], default=None)
            # the decode requests' share served from VRAM (the expert cache's, where the run counted it)
            hit = row.get("expert_cache_hit_rate", row.get("measured_hit_rate"))
            lines.append(
                f"| {report.get('label', '?')} | {'whole GPU' if whole else f'{budget:g} GiB'} | {machine} | "
                f"{fmt(row['decode_tok_s_p50'], 1)} | {fmt(row.get('measured_over_plan'), 2)} | "
                f"{row['experts_in_vram']} of {row['experts_total']} | "
                f"{fmt(row.get('predicted_hit_rate'), 2)} / {fmt(hit, 2)} | {fmt(row.get('peak_vram_gib'), 2)} | "
                f"{'-' if peer is None else fmt(peer['decode_tok_s_p50'], 1) + ' (' + peer['config'] + ')'} | "
                f"{'-' if peer is None else fmt(row['decode_tok_s_p50'] / peer['decode_tok_s_p50'], 2)} | "
                f"{fmt(row['ttft_ms_p50'], 0)} / {'-' if peer is None else fmt(peer['ttft_ms_p50'], 0)} |")
        lines.append("")
        lines.append(f"- `moe/{os.path.basename(path)}`: `{report.get('command', '')}`")
        if report.get("llamacpp_command"):         # bench_moe --llama-json: llama.cpp's rows from an earlier run
            lines.append(f"  (llama.cpp's rows: `{report['llamacpp_command']}` on {report.get('llamacpp_device', '?')})")
    return lines


SERVE_HEADER = ("| model | GPU budget | concurrent requests | machine | helmc tok/s | helmc peak VRAM GiB | "
                "llama.cpp tok/s (config, peak VRAM GiB) | helmc / llama.cpp |\n"
                "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")


def serve_section(folder: str) -> list[str]:
    """The served rows of results/moe_serve/*.json (benchmarks/bench_moe_serve.py): `helmc serve` decoding N
    streamed requests at once beside llama.cpp's `llama-batched-bench` at N, its fastest configuration within the
    budget."""
    paths = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not paths:
        return []
    lines = ["", "Serving (`python -m benchmarks.bench_moe_serve`): decode tok/s of all the requests together, N "
             "streamed requests through `helmc serve` beside `llama-batched-bench` at N.", "", SERVE_HEADER]
    commands = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        n, h = report["concurrency"], report["helmc"]
        key = f"decode_tok_s_at_{n}"
        peer = next((r for r in report.get("llamacpp", [])
                     if r["config"] == report.get("llamacpp_fastest_within_budget")), None)
        peer_text = "-" if peer is None else f"{fmt(peer[key], 1)} ({peer['config']}, {fmt(peer['peak_vram_gib'], 2)})"
        lines.append(f"| {report.get('label', '?')} | {report['budget_gib']:g} GiB | {n} | {report.get('device', '?')} | "
                     f"{fmt(h[key], 1)} | {fmt(h.get('peak_vram_gib'), 2)} | {peer_text} | "
                     f"{fmt(report.get('moe_serve_ratio_vs_llamacpp'), 2)} |")
        if report.get("command"):
            commands.append(f"- `moe_serve/{os.path.basename(path)}`: `{report['command']}`")
    return lines + [""] + commands


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="folder of bench_decode JSON files")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    a = ap.parse_args(argv)
    text = table(a.results)
    if a.check:
        current = open(a.out).read() if os.path.exists(a.out) else ""
        if current != text:
            print(f"{a.out} is not what {a.results} gives: run python -m benchmarks.make_table", file=sys.stderr)
            return 1
        return 0
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
