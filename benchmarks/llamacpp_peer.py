"""llama.cpp as the peer in bench_decode.py: `llama-bench` on the same GGUF file, in the same run.

    from benchmarks.llamacpp_peer import llama_bench
    llama_bench("/tmp/lc/build/bin/llama-bench", "model.gguf", ngl=0, prompt_len=128, new_tokens=64)

Build llama.cpp from source with CUDA on the GPU machine (benchmarks/README.md). `-ngl N` keeps the
last N blocks on the GPU (0: all on the CPU, 99: all on the GPU); llama-bench's own JSON output is parsed,
never its table. TTFT is taken as prompt_len / prompt tok/s (llama-bench times the prompt alone).
bench_decode takes its llama.cpp options (add_arguments), its runs (bench_each_ngl) and each helmc row's ratios
against them (ratios, within_vram) from here.
"""
from __future__ import annotations

import json
import os
import subprocess

from benchmarks.peak_vram import smi_peak_vram


def add_arguments(ap) -> None:
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary: run it on the --model GGUF")
    ap.add_argument("--llama-ngl", default="0",
                    help="comma-separated -ngl values for llama-bench, or auto: the largest -ngl whose measured peak "
                         "VRAM is within --gpu-budget (searched), the one below it, and 99 (all on the GPU)")
    ap.add_argument("--llama-gguf", default=None,
                    help="the GGUF file llama-bench runs (default --model; for an HF --model, the same shapes as GGUF)")
    ap.add_argument("--threads", type=int, default=None, help="llama-bench threads (default: its own)")
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench repetitions (-r; a 32K prompt takes minutes)")


def bench_each_ngl(a):
    """llama_bench for each --llama-ngl value in turn (`auto`: ngl_search within --gpu-budget), yielding each result
    as it comes (bench_decode saves it then, so a run cut short keeps what it measured)."""
    gguf_path = a.llama_gguf or a.model

    def run(ngl: int) -> dict:
        return llama_bench(a.llama_bench, gguf_path, ngl, a.prompt_len, a.new_tokens, reps=a.llama_reps,
                           threads=a.threads)
    if a.llama_ngl == "auto":
        yield from ngl_search(run, a.gpu_budget, *block_bytes(gguf_path))
        return
    for ngl in (int(n) for n in a.llama_ngl.split(",")):
        yield run(ngl)


# What llama.cpp holds on the GPU besides its offloaded blocks' weights at an -ngl below the block count (the CUDA
# context, cuBLAS, compute buffers; Qwen3-8B Q4_K fit 13 blocks of 0.1 GiB in 3 GiB): ngl_search's first guess only.
LLAMA_OVERHEAD_GIB = 1.6


def block_bytes(gguf_path: str) -> tuple[int, int]:
    """(blocks, bytes of all blocks' tensors) of a GGUF file, from its tensor table."""
    import gguf
    r = gguf.GGUFReader(gguf_path)
    blocks = {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.")}
    return len(blocks), sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("blk."))


def ngl_search(run, budget_gib: float, blocks: int, total_block_bytes: int):
    """llama.cpp's runs within a VRAM budget, yielded as they come: from a guess (the budget less
    LLAMA_OVERHEAD_GIB over a block's bytes), -ngl one step at a time up while the measured peak VRAM fits and down
    while it does not, so the largest -ngl that fits and the one above it are both measured; then the one below the
    largest that fits (more blocks on the GPU is not always faster), then 99 (all on the GPU). run(ngl) -> a
    llama_bench result."""
    seen: dict[int, dict] = {}

    def fits(r: dict) -> bool:
        if r.get("peak_vram_gib") is None:
            raise RuntimeError("llama-bench -ngl auto: expected nvidia-smi's peak VRAM of each run, found none")
        return r["peak_vram_gib"] <= budget_gib

    per_block = total_block_bytes / blocks
    ngl = max(0, min(blocks, int((budget_gib - LLAMA_OVERHEAD_GIB) * 2**30 // per_block)))
    seen[ngl] = run(ngl)
    yield seen[ngl]
    up = fits(seen[ngl])
    while 0 <= ngl + (1 if up else -1) <= blocks:
        ngl += 1 if up else -1
        seen[ngl] = run(ngl)
        yield seen[ngl]
        if fits(seen[ngl]) != up:
            break
    best = max((n for n, r in seen.items() if fits(r)), default=None)
    for n in (best - 1 if best else None, 99):
        if n is not None and n not in seen:
            seen[n] = run(n)
            yield seen[n]


def describe(r: dict) -> str:
    vram = f", peak VRAM {r['peak_vram_gib']:.2f} GiB" if r.get("peak_vram_gib") is not None else ""
    return f"llama.cpp -ngl {r['ngl']}: decode {r['decode_tok_s_p50']:.2f} tok/s, prompt {r['prompt_tok_s']:.0f} tok/s{vram}"


def ratios(helmc: dict, llama: list[dict], prompt_len: int) -> dict:
    """A helmc row of bench_decode against llama.cpp's runs: per -ngl N, decode and TTFT ratios and
    `prefill_speedup_vs_llamacpp_ngl{N}` (llama.cpp's prompt time over helmc's TTFT); at a 32K prompt,
    `prefill_32k_ratio_vs_llamacpp` against the fastest prompt of the -ngl values given (the aim: >= 2 under
    7 GiB); `decode_ratio_vs_llamacpp_best` over llama.cpp's best -ngl of the run; for a hybrid decode bundle
    `hybrid_decode_ratio_vs_llamacpp`, over llama.cpp's best -ngl within the row's budget (within_budget)
    where the row has one and some -ngl fits it, else over the best of the run (which can mislead: a 7 GiB fp16 row
    said 0.069 against -ngl 99, a 14.9 GiB run)."""
    out = {}
    for r in llama:
        out[f"decode_ratio_vs_llamacpp_ngl{r['ngl']}"] = helmc["decode_tok_s_p50"] / r["decode_tok_s_p50"]
        out[f"ttft_ratio_vs_llamacpp_ngl{r['ngl']}"] = helmc["ttft_ms_p50"] / r["ttft_ms_p50"]
        out[f"prefill_speedup_vs_llamacpp_ngl{r['ngl']}"] = r["ttft_ms_p50"] / helmc["ttft_ms_p50"]
        if prompt_len >= 32768:
            out["prefill_32k_ratio_vs_llamacpp"] = min(out.get("prefill_32k_ratio_vs_llamacpp", float("inf")),
                                                       r["ttft_ms_p50"] / helmc["ttft_ms_p50"])
    best = max(r["decode_tok_s_p50"] for r in llama)
    out["decode_ratio_vs_llamacpp_best"] = helmc["decode_tok_s_p50"] / best
    budget = within_budget(helmc, llama)
    if helmc.get("hybrid"):
        in_budget = budget.get("decode_ratio_vs_llamacpp_within_budget")
        out["hybrid_decode_ratio_vs_llamacpp"] = in_budget if in_budget is not None else helmc["decode_tok_s_p50"] / best
    return out | within_vram(helmc, llama) | budget


def fastest_within(llama: list[dict], gib: float) -> dict | None:
    """llama.cpp's fastest decoding run whose measured peak VRAM is at most `gib` (None: none is)."""
    fits = [r for r in llama if r.get("peak_vram_gib") is not None and r["peak_vram_gib"] <= gib]
    return max(fits, key=lambda r: r["decode_tok_s_p50"], default=None)


def within_budget(helmc: dict, llama: list[dict]) -> dict:
    """The comparison under a VRAM budget: helmc's decode against llama.cpp's fastest -ngl whose
    peak VRAM is within the budget helmc's plan was made for (`gpu_budget_gib`, the row's), and whether helmc's own
    peak stayed within it. Nothing where the row has no budget (a plan for the whole GPU) or llama.cpp's peaks
    went unmeasured."""
    budget = helmc.get("gpu_budget_gib")
    if budget is None:
        return {}
    peer = fastest_within(llama, budget)
    peak = helmc.get("peak_vram_gib")
    out = {"helmc_within_budget": None if peak is None else peak <= budget,
           "llamacpp_ngl_within_budget": None if peer is None else peer["ngl"],
           "decode_ratio_vs_llamacpp_within_budget": (None if peer is None else
                                                      helmc["decode_tok_s_p50"] / peer["decode_tok_s_p50"])}
    if helmc.get("hybrid"):
        out["hybrid_decode_ratio_vs_llamacpp_within_budget"] = out["decode_ratio_vs_llamacpp_within_budget"]
    return out


def within_vram(helmc: dict, llama: list[dict]) -> dict:
    """helmc's decode against llama.cpp's fastest -ngl whose peak VRAM is no more than helmc's: what a user with
    helmc's VRAM would run instead. Both None where helmc's peak went unmeasured (no nvidia-smi) or no -ngl's
    measured peak is within it."""
    peak = helmc.get("peak_vram_gib")
    peer = None if peak is None else fastest_within(llama, peak)
    if peer is None:
        return {"llamacpp_ngl_within_vram": None, "decode_ratio_vs_llamacpp_within_vram": None}
    return {"llamacpp_ngl_within_vram": peer["ngl"],
            "decode_ratio_vs_llamacpp_within_vram": helmc["decode_tok_s_p50"] / peer["decode_tok_s_p50"]}


def llama_bench(binary: str, gguf: str, ngl: int, prompt_len: int, new_tokens: int, reps: int = 3,
                threads: int | None = None, extra: tuple[str, ...] = ()) -> dict:
    if not os.path.isfile(binary):
        raise FileNotFoundError(f"llama-bench: expected the binary at {binary} (build llama.cpp: benchmarks/README.md)")
    cmd = [binary, "-m", gguf, "-p", str(prompt_len), "-n", str(new_tokens), "-r", str(reps), "-ngl", str(ngl),
           "-o", "json", *extra]
    if threads:
        cmd += ["-t", str(threads)]
    with smi_peak_vram() as vram:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    rows = json.loads(proc.stdout)
    prompt = next(r for r in rows if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0)
    gen = next(r for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0)
    return {"system": "llama.cpp", "ngl": ngl, "command": " ".join(cmd), "threads": gen.get("n_threads"),
            "prompt_tok_s": prompt["avg_ts"], "decode_tok_s_p50": gen["avg_ts"], "decode_tok_s_stdev": gen.get("stddev_ts"),
            "ttft_ms_p50": 1000.0 * prompt_len / prompt["avg_ts"], "per_token_ms_p50": 1000.0 / gen["avg_ts"],
            "model_size_bytes": gen.get("model_size"), "build": gen.get("build_commit"),
            "backends": gen.get("backends"),
            "peak_vram_gib": vram.held_gib}


def llama_batched_bench(binary: str, gguf: str, ngl: int, prompt_len: int, new_tokens: int,
                        parallel: tuple[int, ...] = (1, 8), threads: int | None = None,
                        extra: tuple[str, ...] = ()) -> dict:
    """llama.cpp's `llama-batched-bench -npp P -ntg T -npl 1,8`: P-token prompts (not shared) and T new tokens for
    each of B sequences decoded together (`extra`: more of its arguments, e.g. `-ncmoe N`). Returns per B its S_TG
    (all sequences' generated tokens per second of generation) and S_PP, parsed from the table it prints (columns
    PP TG B N_KV T_PP S_PP T_TG S_TG T S), and the peak VRAM it held (nvidia-smi, as llama_bench)."""
    if not os.path.isfile(binary):
        raise FileNotFoundError(f"llama-batched-bench: expected the binary at {binary} (build llama.cpp: benchmarks/README.md)")
    ctx = max(parallel) * (prompt_len + new_tokens)
    cmd = [binary, "-m", gguf, "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", ",".join(map(str, parallel)),
           "-ngl", str(ngl), "-c", str(ctx), *extra]
    if threads:
        cmd += ["-t", str(threads)]
    with smi_peak_vram() as vram:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(c.replace(".", "", 1).isdigit() for c in cells):
            pp, tg, b = (int(c) for c in cells[:3])
            rows[b] = {"pp": pp, "tg": tg, "n_kv": int(cells[3]), "t_pp_s": float(cells[4]), "prompt_tok_s": float(cells[5]),
                       "t_tg_s": float(cells[6]), "decode_tok_s": float(cells[7])}
    missing = [b for b in parallel if b not in rows]
    if missing:
        raise RuntimeError(f"llama-batched-bench: expected a row for B in {parallel}, found none for {missing}:\n"
                           f"{proc.stdout[-2000:]}")
    return {"system": "llama.cpp llama-batched-bench", "ngl": ngl, "command": " ".join(cmd), "by_batch": rows,
            "peak_vram_gib": vram.held_gib}
