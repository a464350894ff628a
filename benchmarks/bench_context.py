"""Longest context and decode speed vs context: helmc beside HF Accelerate under the same GPU budget.

For the GPU test machine (Qwen3-8B fp16, --gpu-budget 7), one command for both:
    python -m benchmarks.bench_context --bundle BUNDLE --weights WEIGHTS_DIR \
        --hf-model HF_MODEL_DIR --gpu-budget 7 --contexts 1024,8192,32768 --new-tokens 16 --out $OUT/ctx.json
    ... --dry-run     prints what would run, with the time limits, and touches no GPU

Each system runs in its own process (one's CUDA allocations and caches cannot help or hurt the
other), loads the model once and walks the contexts in ascending order; a context is the prompt
length plus the new tokens. Per system and context it records prefill seconds (time to the first
token), decode tok/s over the remaining new tokens, peak VRAM, or why it failed: helmc's refusal
message, out of memory, an error, or the time limit ("timeout": the context that was running when
the system's time ran out; later ones "not_run"). A context after a failed one (oom / error) is
skipped: a longer one would fail the same way.

Time limits: each system gets --helmc-time / --hf-time seconds (its load included) and all of them
together --total-time, so one command stays under the device's 10-minute limit; a system started
late gets what is left of the total.

Peak VRAM: a thread samples cudaMemGetInfo every 20 ms during each context; the figure is the
device's used memory above what nvidia-smi showed before the worker started (CUDA context, weights,
KV, workspace: everything the process holds, CuPy's pool and TVM's allocator alike). HF also
records torch.cuda.max_memory_allocated (tensors only).

HF Accelerate: device_map="auto", max_memory GPU = budget - --hf-headroom GiB for weights, and
torch.cuda.set_per_process_memory_fraction caps the process's allocations at the budget.
helmc: Session.load(bundle, weights_dir, kv_page_tokens, kv_watermark, kv_offload) and
generate(prompt_ids, max_new_tokens, temperature=0, stop_at_eos=False); its KV capacity for the
session (tokens that fit and what limits them) is recorded after loading.
Prompts are random token ids (seeded), the same for both systems. Before the first timed context each
system serves one untimed warm-up request (--warmup-tokens prompt, 4 new tokens), so one-time costs
(kernel loading, allocator growth, lazy compilation in CuPy/torch) do not land on the shortest context.
helmc's target: decode tok/s at 32K >= 70% of that at 1K.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.peak_vram import PeakVram, cuda_used_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024 ** 3
SYSTEMS = ("helmc", "hf")
FAILED = ("oom", "error")


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(100, min(vocab, 150000), n).tolist()


def emit(rec: dict) -> None:
    print("RESULT " + json.dumps(rec), flush=True)


# ------------------------------------------------------------------ workers
def free_device_pools() -> None:
    """Hand back what this process's libraries pool on the device (bench_decode between rows: an earlier row's
    pooled memory would count in the next one's peak): CuPy's pools, TVM's VM storage, torch's cache."""
    import gc

    gc.collect()
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except ImportError:
        pass
    try:                                        # TVM's pooled device allocations (the VMs' storage) likewise
        import tvm_ffi
        (tvm_ffi.get_global_func("vm.builtin.memory_manager.clear", allow_missing=True) or (lambda: None))()
    except ImportError:
        pass
    import torch

    torch.cuda.empty_cache()


def worker_helmc(args) -> None:
    import cupy

    from helmc.errors import HelmcError
    from helmc.runtime.session import Session
    vram = PeakVram(cuda_used_bytes(cupy.cuda.runtime.memGetInfo), args.baseline_bytes)
    t = time.perf_counter()
    with vram:
        s = Session.load(args.bundle, weights_dir=args.weights, kv_page_tokens=args.kv_page_tokens,
                         kv_watermark=args.kv_watermark, kv_offload=not args.no_kv_offload)
    loaded = {"system": "helmc", "event": "loaded", "load_s": round(time.perf_counter() - t, 1),
              "plan": s.plan.describe(), "plan_max_context": s.plan.memory.max_context, "vram_peak_gib": vram.peak_gib}
    try:
        from helmc.runtime.session import request_kv_capacity
        cap = request_kv_capacity(s, max(args.contexts) - args.new_tokens)
        loaded.update(kv_tokens_fit=cap.tokens_fit, kv_limited_by=cap.limited_by)
    except ImportError:
        pass
    emit(loaded)
    vocab = s.spec.vocab_size
    if args.warmup_tokens:
        s.generate(prompt_ids=prompt_ids(args.warmup_tokens, vocab, seed=1), max_new_tokens=4, temperature=0,
                   stop_at_eos=False)
    failed = None
    for ctx in args.contexts:
        rec = {"system": "helmc", "context": ctx}
        if failed:
            emit(dict(rec, status="skipped", why=f"a shorter context failed ({failed})"))
            continue
        emit({"system": "helmc", "event": "start", "context": ctx})
        try:
            with vram:
                r = s.generate(prompt_ids=prompt_ids(ctx - args.new_tokens, vocab), max_new_tokens=args.new_tokens,
                               temperature=0, stop_at_eos=False)
            rec.update(status="ok", prefill_s=round(r.ttft_ms / 1000, 3), decode_tok_s=round(r.decode_tok_s, 3),
                       tokens=len(r.tokens), p50_ms=round(float(_median(r.per_token_ms)), 2) if r.per_token_ms else None)
        except HelmcError as e:
            rec.update(status="refused", why=str(e))
        except Exception as e:                                   # out of memory or a bug: recorded, not hidden
            oom = "OutOfMemory" in type(e).__name__ or "out of memory" in str(e).lower()
            rec.update(status="oom" if oom else "error", why=f"{type(e).__name__}: {e}"[:500])
            failed = f"{rec['status']} at {ctx}"
        rec["vram_peak_gib"] = vram.peak_gib
        emit(rec)


def worker_hf(args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_budget * GIB / total))
    vram = PeakVram(cuda_used_bytes(torch.cuda.mem_get_info), args.baseline_bytes)
    t = time.perf_counter()
    with vram:
        model = AutoModelForCausalLM.from_pretrained(
            args.hf_model, dtype=torch.float16, device_map="auto",
            max_memory={0: f"{args.gpu_budget - args.hf_headroom}GiB", "cpu": f"{args.hf_cpu_gib}GiB"})
    model.eval()
    vocab = AutoConfig.from_pretrained(args.hf_model).vocab_size
    dmap = getattr(model, "hf_device_map", {})
    on_gpu = sum(1 for d in dmap.values() if str(d) in ("0", "cuda:0"))
    emit({"system": "hf", "event": "loaded", "load_s": round(time.perf_counter() - t, 1),
          "modules_on_gpu": on_gpu, "modules": len(dmap), "vram_peak_gib": vram.peak_gib})
    if args.warmup_tokens:
        _hf_generate(model, torch, prompt_ids(args.warmup_tokens, vocab, seed=1), 4)
        torch.cuda.empty_cache()               # as after every context: cached blocks must not count against HF
    failed = None
    for ctx in args.contexts:
        rec = {"system": "hf", "context": ctx}
        if failed:
            emit(dict(rec, status="skipped", why=f"a shorter context failed ({failed})"))
            continue
        emit({"system": "hf", "event": "start", "context": ctx})
        torch.cuda.reset_peak_memory_stats()
        try:
            with vram:
                ttft, tok_s = _hf_generate(model, torch, prompt_ids(ctx - args.new_tokens, vocab), args.new_tokens)
            rec.update(status="ok", prefill_s=round(ttft, 3), decode_tok_s=round(tok_s, 3))
        except torch.cuda.OutOfMemoryError as e:
            failed = f"out of memory at {ctx}"
            rec.update(status="oom", why=str(e).splitlines()[0][:300])
        except Exception as e:
            failed = f"error at {ctx}"
            rec.update(status="error", why=f"{type(e).__name__}: {e}"[:500])
        rec["vram_peak_gib"] = vram.peak_gib
        rec["torch_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        torch.cuda.empty_cache()
        emit(rec)


def _median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _hf_generate(model, torch, ids, n):
    """Greedy decode with the KV cache; returns (prefill seconds, decode tok/s over tokens 2..n)."""
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        t0 = time.perf_counter()
        try:
            out = model(input_ids=x, use_cache=True, logits_to_keep=1)   # never the [S, vocab] logits
        except TypeError:
            out = model(input_ids=x, use_cache=True, num_logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tok.item()
        t_first = time.perf_counter()
        past = out.past_key_values
        for _ in range(n - 1):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tok.item()
        t_end = time.perf_counter()
    return t_first - t0, (n - 1) / (t_end - t_first) if n > 1 else 0.0


# ------------------------------------------------------------------ driver
def device_used_bytes() -> int:
    """Memory used on GPU 0 as nvidia-smi reports it (0 where it cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(float(out.strip().splitlines()[0])) * 2 ** 20
    except Exception:
        return 0


def parse_records(system: str, stdout: str, rc, stderr: str, contexts: list[int], limit_s: float) -> list[dict]:
    """A worker's RESULT lines as records; when it was cut off, the context it was running becomes
    status "timeout" (or "crashed") and the ones after it "not_run"."""
    recs, started = [], []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[7:])
            if rec.get("event") == "start":
                started.append(rec["context"])
            else:
                recs.append(rec)
    done = {r["context"] for r in recs if "context" in r}
    if rc != 0:
        status = "timeout" if rc == "timeout" else "crashed"
        why = f"the system's time limit of {limit_s:.0f} s ran out" if rc == "timeout" else f"the worker exited with {rc}"
        running = next((c for c in started if c not in done), None)
        for c in contexts:
            if c == running:
                recs.append({"system": system, "context": c, "status": status, "why": why})
            elif c not in done:
                recs.append({"system": system, "context": c, "status": "not_run", "why": f"not reached: {why}"})
        recs.append({"system": system, "event": "exit", "rc": rc, "stderr_tail": stderr[-1500:]})
    return recs


def run_worker(system: str, argv: list[str], limit_s: float, contexts: list[int]) -> list[dict]:
    baseline = device_used_bytes()
    cmd = [sys.executable, "-m", "benchmarks.bench_context", "--worker", system, "--baseline-bytes", str(baseline)] + argv
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=env, cwd=ROOT)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    return parse_records(system, out, rc, err, contexts, limit_s)


def summarize(recs: list[dict], contexts: list[int]) -> dict:
    out = {}
    for system in SYSTEMS:
        mine = [r for r in recs if r.get("system") == system and "context" in r]
        if not mine:
            continue
        ok = {r["context"]: r for r in mine if r.get("status") == "ok"}
        s = {"largest_context": max(ok) if ok else 0,
             "decode_tok_s": {c: ok[c]["decode_tok_s"] for c in contexts if c in ok},
             "prefill_s": {c: ok[c]["prefill_s"] for c in contexts if c in ok},
             "failures": {r["context"]: r["status"] for r in mine if r.get("status") != "ok"}}
        lo, hi = min(contexts), max(contexts)
        if lo in ok and hi in ok and ok[lo]["decode_tok_s"]:
            s[f"ratio_{hi}_vs_{lo}"] = round(ok[hi]["decode_tok_s"] / ok[lo]["decode_tok_s"], 3)
        out[system] = s
    return out


def time_limits(systems: list[str], per_system: dict[str, float], total: float) -> list[tuple[str, float]]:
    """What each system would get if every one used its whole limit (the driver re-trims at run time)."""
    left, out = total, []
    for s in systems:
        out.append((s, max(0.0, min(per_system[s], left))))
        left -= out[-1][1]
    return out


def print_table(recs: list[dict], summary: dict) -> None:
    print(f"\n{'system':<7}{'context':>9}{'status':>10}{'prefill s':>11}{'decode tok/s':>14}{'peak VRAM GiB':>15}  note")
    for r in recs:
        if "context" in r:
            vram = r.get("vram_peak_gib")
            print(f"{r['system']:<7}{r['context']:>9}{r['status']:>10}{r.get('prefill_s', ''):>11}"
                  f"{r.get('decode_tok_s', ''):>14}{'' if vram is None else vram:>15}  {r.get('why', '')[:120]}")
        elif r.get("event") == "exit":
            last = [line for line in r["stderr_tail"].splitlines() if line.strip()][-1:] or [""]
            print(f"{r['system']:<7} worker exited ({r['rc']}): {last[0][:200]}")
        else:
            print(f"{r['system']:<7} {json.dumps({k: v for k, v in r.items() if k != 'system'})[:300]}")
    for system, s in summary.items():
        print(f"{system}: largest context {s['largest_context']}, decode tok/s {s['decode_tok_s']}"
              + "".join(f", {k} = {v}" for k, v in s.items() if k.startswith("ratio")))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle")
    ap.add_argument("--weights")
    ap.add_argument("--hf-model", help="Hugging Face model dir (config + safetensors) for the baseline")
    ap.add_argument("--gpu-budget", type=float, default=7.0, help="GiB of VRAM each system may use")
    ap.add_argument("--contexts", nargs="+", default=["1024,8192,32768"],
                    help="comma- or space-separated (scripts/device_run.sh splits its arguments at commas)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--warmup-tokens", type=int, default=128,
                    help="prompt length of one untimed warm-up request per system (0: none)")
    ap.add_argument("--systems", default="helmc,hf")
    ap.add_argument("--kv-page-tokens", type=int, default=512)
    ap.add_argument("--kv-watermark", type=float, default=0.8)
    ap.add_argument("--no-kv-offload", action="store_true")
    ap.add_argument("--hf-headroom", type=float, default=1.0, help="GiB of the budget HF keeps free of weights")
    ap.add_argument("--hf-cpu-gib", type=int, default=110)
    ap.add_argument("--helmc-time", type=float, default=320, help="seconds for helmc, load included")
    ap.add_argument("--hf-time", type=float, default=200, help="seconds for HF Accelerate, load included")
    ap.add_argument("--total-time", type=float, default=520, help="seconds for all systems together")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--baseline-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.contexts = sorted({int(c) for part in args.contexts for c in part.split(",") if c})
    except ValueError:
        ap.error(f"--contexts expected comma-separated integers, found {args.contexts!r}")
    if not args.contexts or args.contexts[0] <= args.new_tokens:
        ap.error(f"--contexts expected values above --new-tokens ({args.new_tokens}), found {args.contexts}")
    if args.worker:
        (worker_helmc if args.worker == "helmc" else worker_hf)(args)
        return 0
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems expected some of {','.join(SYSTEMS)}, found {unknown}")
    if "helmc" in systems and not args.bundle:
        ap.error("--bundle is needed for helmc")
    if "hf" in systems and not args.hf_model:
        ap.error("--hf-model is needed for the HF baseline")
    per_system = {"helmc": args.helmc_time, "hf": args.hf_time}
    if args.dry_run:
        for system, limit in time_limits(systems, per_system, args.total_time):
            print(f"{system}: contexts {args.contexts}, {args.new_tokens} new tokens each, GPU budget "
                  f"{args.gpu_budget} GiB, at most {limit:.0f} s")
        return 0
    recs: list[dict] = []
    t_start = time.monotonic()
    for system in systems:
        limit = max(1.0, min(per_system[system], args.total_time - (time.monotonic() - t_start)))
        print(f"[bench_context] running {system} (at most {limit:.0f} s) ...", file=sys.stderr, flush=True)
        recs += run_worker(system, argv, limit, args.contexts)
    summary = summarize(recs, args.contexts)
    print_table(recs, summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "baseline_bytes")},
                       "records": recs, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
