"""Longest context and decode speed vs context: helmc beside HF Accelerate under the same GPU budget.

Issue 5's benchmark, for the GPU test machine (Qwen3-8B fp16, --gpu-budget 7):
    PYTHONPATH=. python scripts/bench_context.py --bundle BUNDLE --weights WEIGHTS_DIR \
        --hf-model HF_MODEL_DIR --gpu-budget 7 --contexts 1024,8192,32768 --new-tokens 16 --out $OUT/ctx.json

Each system runs in its own process (so one's CUDA allocations and caches cannot help or hurt the
other), loads the model once and walks the contexts in ascending order; a context is the prompt
length plus the new tokens. Per context it records TTFT, decode tok/s and peak VRAM, or why it
failed (helmc's refusal message, an out-of-memory error). The largest context that ran is each
system's "largest context"; helmc's target is decode tok/s at 32K >= 70% of that at 1K.

HF Accelerate: device_map="auto", max_memory GPU = budget - --hf-headroom GiB for weights, and
torch.cuda.set_per_process_memory_fraction caps the whole process (weights, KV, activations) at
the budget, which is what "the same budget" means for helmc too.

helmc is driven through the Python API the runtime provides (assumed here, issue 5):
    s = Session.load(bundle_dir, weights_dir=..., kv_page_tokens=..., kv_watermark=..., kv_offload=...)
    r = s.generate(prompt_ids=[...], max_new_tokens=N, temperature=0)   # r.tokens, r.ttft_ms, r.decode_tok_s
Prompts are random token ids (seeded), the same for both systems.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024 ** 3


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(100, min(vocab, 150000), n).tolist()


def emit(rec: dict) -> None:
    print("RESULT " + json.dumps(rec), flush=True)


# ------------------------------------------------------------------ workers
def worker_helmc(args) -> None:
    sys.path.insert(0, ROOT)
    from helmc.errors import HelmcError
    from helmc.runtime.session import Session
    t = time.perf_counter()
    s = Session.load(args.bundle, weights_dir=args.weights, kv_page_tokens=args.kv_page_tokens,
                     kv_watermark=args.kv_watermark, kv_offload=not args.no_kv_offload)
    load_s = time.perf_counter() - t
    vocab = s.spec.vocab_size
    cap = getattr(s, "kv_capacity", None)
    emit({"system": "helmc", "event": "loaded", "load_s": round(load_s, 1),
          "max_context": getattr(cap, "tokens_fit", None) or getattr(s.plan, "max_context", None)})
    for ctx in args.contexts:
        rec = {"system": "helmc", "context": ctx}
        try:
            r = _generate(s, prompt_ids(ctx - args.new_tokens, vocab), args.new_tokens)
            rec.update(status="ok", ttft_ms=round(r.ttft_ms, 1), decode_tok_s=round(r.decode_tok_s, 3),
                       tokens=len(r.tokens))
        except HelmcError as e:
            rec.update(status="refused", why=str(e))
        except Exception as e:                                   # out of memory or a bug: recorded, not hidden
            rec.update(status="error", why=f"{type(e).__name__}: {e}"[:500])
        rec["vram_used_gib"] = _device_used_gib()
        emit(rec)


def _generate(s, ids, n):
    try:
        return s.generate(prompt_ids=ids, max_new_tokens=n, temperature=0, stop_at_eos=False)
    except TypeError:                                            # an API without stop_at_eos
        return s.generate(prompt_ids=ids, max_new_tokens=n, temperature=0)


def _device_used_gib():
    try:
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        return round((total - free) / GIB, 2)
    except Exception:
        return None


def worker_hf(args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_budget * GIB / total))
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        args.hf_model, dtype=torch.float16, device_map="auto",
        max_memory={0: f"{args.gpu_budget - args.hf_headroom}GiB", "cpu": f"{args.hf_cpu_gib}GiB"})
    model.eval()
    vocab = AutoConfig.from_pretrained(args.hf_model).vocab_size
    on_gpu = sum(1 for d in getattr(model, "hf_device_map", {}).values() if str(d) in ("0", "cuda:0"))
    emit({"system": "hf", "event": "loaded", "load_s": round(time.perf_counter() - t, 1),
          "modules_on_gpu": on_gpu, "modules": len(getattr(model, "hf_device_map", {}))})
    failed = None
    for ctx in args.contexts:
        rec = {"system": "hf", "context": ctx}
        if failed:
            rec.update(status="skipped", why=f"a shorter context already failed ({failed})")
            emit(rec)
            continue
        torch.cuda.reset_peak_memory_stats()
        try:
            ttft, tok_s = _hf_generate(model, torch, prompt_ids(ctx - args.new_tokens, vocab), args.new_tokens)
            rec.update(status="ok", ttft_ms=round(ttft, 1), decode_tok_s=round(tok_s, 3))
        except torch.cuda.OutOfMemoryError as e:
            failed = f"out of memory at {ctx}"
            rec.update(status="oom", why=str(e).splitlines()[0][:300])
        rec["vram_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        torch.cuda.empty_cache()
        emit(rec)


def _hf_generate(model, torch, ids, n):
    """Greedy decode with the KV cache; returns (TTFT ms, decode tok/s over tokens 2..n)."""
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
    return 1000 * (t_first - t0), (n - 1) / (t_end - t_first) if n > 1 else 0.0


# ------------------------------------------------------------------ driver
def run_worker(system: str, argv: list[str], timeout: int) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system] + argv
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    recs = []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {timeout} s", "timeout"
    for line in out.splitlines():
        if line.startswith("RESULT "):
            recs.append(json.loads(line[7:]))
    if rc != 0:
        recs.append({"system": system, "event": "exit", "rc": rc, "stderr_tail": err[-1500:]})
    return recs


def summarize(recs: list[dict], contexts: list[int]) -> dict:
    out = {}
    for system in ("helmc", "hf"):
        ok = {r["context"]: r for r in recs if r.get("system") == system and r.get("status") == "ok"}
        s = {"largest_context": max(ok) if ok else 0,
             "decode_tok_s": {c: ok[c]["decode_tok_s"] for c in contexts if c in ok}}
        lo, hi = min(contexts), max(contexts)
        if lo in ok and hi in ok and ok[lo]["decode_tok_s"]:
            s[f"ratio_{hi}_vs_{lo}"] = round(ok[hi]["decode_tok_s"] / ok[lo]["decode_tok_s"], 3)
        out[system] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle")
    ap.add_argument("--weights")
    ap.add_argument("--hf-model", help="Hugging Face model dir (config + safetensors) for the baseline")
    ap.add_argument("--gpu-budget", type=float, default=7.0, help="GiB of VRAM each system may use")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--systems", default="helmc,hf")
    ap.add_argument("--kv-page-tokens", type=int, default=512)
    ap.add_argument("--kv-watermark", type=float, default=0.8)
    ap.add_argument("--no-kv-offload", action="store_true")
    ap.add_argument("--hf-headroom", type=float, default=1.0, help="GiB of the budget HF keeps free of weights")
    ap.add_argument("--hf-cpu-gib", type=int, default=110)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per system")
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", choices=["helmc", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.contexts = sorted(int(c) for c in str(args.contexts).split(","))
    if args.worker:
        (worker_helmc if args.worker == "helmc" else worker_hf)(args)
        return
    systems = [s for s in args.systems.split(",") if s]
    if "helmc" in systems and not args.bundle:
        ap.error("--bundle is needed for helmc")
    if "hf" in systems and not args.hf_model:
        ap.error("--hf-model is needed for the HF baseline")
    argv = [a for a in sys.argv[1:]]
    recs = []
    for system in systems:
        print(f"[bench_context] running {system} ...", file=sys.stderr, flush=True)
        recs += run_worker(system, argv, args.timeout)
    summary = summarize(recs, args.contexts)
    print(f"\n{'system':<7}{'context':>9}{'status':>9}{'TTFT ms':>11}{'decode tok/s':>14}{'VRAM GiB':>10}  note")
    for r in recs:
        if "context" in r:
            vram = r.get("vram_used_gib", r.get("vram_peak_gib"))
            print(f"{r['system']:<7}{r['context']:>9}{r['status']:>9}{r.get('ttft_ms', ''):>11}"
                  f"{r.get('decode_tok_s', ''):>14}{'' if vram is None else vram:>10}  {r.get('why', '')[:120]}")
        elif r.get("event") == "exit":
            last = [l for l in r["stderr_tail"].splitlines() if l.strip()][-1:] or [""]
            print(f"{r['system']:<7} worker exited ({r['rc']}): {last[0][:200]}")
        else:
            print(f"{r['system']:<7} {json.dumps({k: v for k, v in r.items() if k != 'system'})[:300]}")
    for system, s in summary.items():
        print(f"{system}: largest context {s['largest_context']}, decode tok/s {s['decode_tok_s']}"
              + "".join(f", {k} = {v}" for k, v in s.items() if k.startswith("ratio")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "records": recs,
                       "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
