#!/usr/bin/env python3
"""Decode benchmark on the GPU machine: helmc vs HF Accelerate (same GPU budget) vs HF on the whole GPU, or,
for a GGUF file, helmc vs llama.cpp's llama-bench on the same file.

    python -m benchmarks.bench_decode --model MODEL_DIR --bundle SPLIT_BUNDLE [--bundle ALL_GPU_BUNDLE ...]
        [--gpu-budget 7] [--prompt-len 128] [--new-tokens 128] [--requests 10] [--out bench.json]
    python -m benchmarks.bench_decode --model model.gguf --bundle BUNDLE --llama-bench /tmp/lc/build/bin/llama-bench
        --llama-ngl 0,99 [--threads 16] ...      (HF peers are skipped for a GGUF file; llamacpp_peer.py)

Every system gets the same random prompt (seeded ids), greedy decoding, batch 1, no early stop at EOS. Per request:
TTFT (prompt in -> first token out), decode tok/s ((n - 1) / time from the first to the last token) and per-token
latencies; the median over requests, after one warm-up request of the same length. Accelerate (~0.8 tok/s) has its
own request count and length (--peer-requests, --accelerate-new-tokens; decode is steady-state).
Also measured in the same run: host DRAM read (torch sum over 2 GiB, all threads), GPU HBM (device copy, read +
written) and pinned host-to-device bandwidth; the roofline per token is the bytes each side reads per token over
its rate, beside T_plan.
With --calibrate, `helmc calibrate` runs first in the same process on the same machine (helmc.planner.calibrate:
each device's per-block delta and per-token tail fitted on the bundles' own compiled stages against
--hardware, default the first bundle's hardware.json), and every helmc row also reports the cost
model's T_plan for that bundle's split under the calibrated profile ("T_plan (calibrated)") and
measured / that (the calibrated profile is written beside --out). With --profile HW.json instead (what `helmc
profile` measured in the same run), the rows report "T_plan (profile)": the plan's own cost model for each bundle's
placement under that profile, no calibration (does the profile predict this machine?); a split's row adds its CPU stage's read per decode
step and the profile's stage read over it (`profile_dram_vs_measured`; M's: `profile_gemv_read_vs_measured`).
--replan runs each bundle with its plan made again from --profile (`helmc plan BUNDLE hardware.json`, no
compiling), as a user does on a machine of their own;
--variants split,all_gpu also runs each bundle as its plain split in the same budget (a hybrid row then says whether
its greedy tokens equal the split's, and where not, whether they part at a logit tie: benchmarks.greedy_trace.GreedyTrace)
and planned for the whole GPU, each its own row.
A hybrid decode bundle (its plan has streamed groups) is benchmarked like any other; its row adds the
groups, the bytes through the staging ring per token and their PCIe rate, the host weights' read rate per token
and its share of the profile's DRAM + PCIe rate. With --llama-bench, every helmc row gets its ratios against
llama.cpp's runs (llamacpp_peer.ratios says which).
helmc's `peak_vram_gib`, beside llama.cpp's per -ngl: PeakVram (peak_vram.py) samples the device's used memory
every 20 ms through a bundle's load, warm-up and requests; the figure is the most seen above what nvidia-smi showed
when this script started, before any CUDA call, so it counts this process's CUDA context (as llama.cpp's counts its
own) and whatever earlier steps left on the device (the bandwidth buffers, calibration and earlier bundles: their
memory is handed back, torch's cache emptied and CuPy's pools freed, but not the libraries' code and handles).
None without nvidia-smi. llama.cpp's nvidia-smi samples every 100 ms, so it may miss a peak helmc's does not: the
within-VRAM comparison (llamacpp_peer.within_vram) leans, if anything, in llama.cpp's favour.
Greedy tokens of the first request are compared with HF's (all on the GPU): first divergence, and
whether helmc's token there is in HF's top 5. Results are written to --out after every system, so a
run cut short still leaves what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np

from benchmarks import llamacpp_peer  # the peer's options, runs and ratios
from benchmarks.bench_context import free_device_pools
from benchmarks.greedy_trace import GreedyTrace, compare_greedy, greedy_trace  # numpy only
from benchmarks.measured_rates import cpu_stage_fields, hybrid_fields, read_bytes
from benchmarks.peak_vram import PeakVram, cuda_used_bytes, gpu_memory_used_mib
from helmc.hardware.profile import HardwareProfile  # pure Python: no torch, no TVM
from helmc.planner.replan_bundle import replan_bundle

GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def summarize(results: list[dict]) -> dict:
    """Medians over requests of TTFT, decode tok/s and each request's median per-token latency."""
    return {"requests": len(results),
            "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in results),
            "decode_tok_s_p50": statistics.median(r["decode_tok_s"] for r in results),
            "per_token_ms_p50": statistics.median(statistics.median(r["per_token_ms"]) for r in results),
            "new_tokens": len(results[0]["tokens"])}


# ---- Machine ceilings, measured now ------------------------------------------------------------
def measure_bandwidths() -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    host = torch.ones(1 << 29, dtype=torch.float32)                     # 2 GiB
    best = min(_timed(lambda: host.sum()) for _ in range(5))
    dev_a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty_like(dev_a)
    hbm = min(_timed(lambda: dev_b.copy_(dev_a), cuda=True) for _ in range(10))
    pinned = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    h2d = min(_timed(lambda: dst.copy_(pinned, non_blocking=True), cuda=True) for _ in range(10))
    out = {"host_read_gbs": host.numel() * 4 / best / GB, "hbm_copy_gbs": 2 * dev_a.numel() / hbm / GB,
           "h2d_pinned_gbs": pinned.numel() / h2d / GB, "threads": torch.get_num_threads()}
    del host, dev_a, dev_b, pinned, dst
    torch.cuda.empty_cache()
    return out


def _timed(fn, cuda: bool = False) -> float:
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


# ---- helmc -------------------------------------------------------------------------------------
def rss_bytes() -> dict:
    """This process's resident memory by kind (/proc/self/status): anonymous (copies the process made), file-backed
    (mmapped weights' pages: the runtime unmaps each once bound) and shared (pinned host memory: the host blocks)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def bench_helmc(bundle: str, model: str, prompt: list[int], new_tokens: int, requests: int, bw: dict,
                calibrated=None, cuda_graph: bool = True, label: str = "calibrated", plan=None,
                vram_baseline_mib: int | None = None, trace: bool = False) -> dict:
    import torch

    from helmc.runtime.session import Session

    vram = None if vram_baseline_mib is None else PeakVram(cuda_used_bytes(torch.cuda.mem_get_info), vram_baseline_mib * 2**20)
    free, total = torch.cuda.mem_get_info() if vram is not None else (0, 0)
    held_before = None if vram is None else max(0, total - free - vram_baseline_mib * 2**20) / 2**30  # context, leftovers
    with contextlib.nullcontext() if vram is None else vram:
        t = time.perf_counter()
        s = Session.load(bundle, weights_dir=model, cuda_graph=cuda_graph, plan=plan)
        load_s = time.perf_counter() - t
        plan = s.plan
        log(f"helmc {bundle}: loaded in {load_s:.1f} s, plan {plan.describe()}, T_plan {plan.predictions.t_plan_ms:.1f} ms")
        # Warm-up as long as a request: every KV page bucket's CUDA graph is captured before timing (a 4-token warm-up
        # left the captures in the first timed request, ~10 ms per token of a 32-token request; llama-bench also
        # warms up).
        s.generate(prompt_ids=prompt, max_new_tokens=new_tokens, temperature=0.0, stop_at_eos=False)
        cpu_steps = time_cpu_stage(s)
        runs = []
        for i in range(requests):
            r = s.generate(prompt_ids=prompt, max_new_tokens=new_tokens, temperature=0.0, stop_at_eos=False)
            runs.append({"tokens": list(r.tokens), "ttft_ms": r.ttft_ms, "decode_tok_s": r.decode_tok_s,
                         "per_token_ms": list(r.per_token_ms)})
            log(f"  request {i}: TTFT {r.ttft_ms:.1f} ms, {r.decode_tok_s:.2f} tok/s")
    out = summarize(runs)
    out["peak_vram_gib"] = None if vram is None else vram.peak_gib
    out["vram_held_before_load_gib"] = None if held_before is None else round(held_before, 3)
    if plan.memory.usable_vram_bytes and plan.placement.uses_gpu:      # the budget the plan was made for (a whole GPU's free VRAM if none)
        out["gpu_budget_gib"] = round(plan.memory.usable_vram_bytes / 2 ** 30, 3)
    if vram is not None:
        log(f"  peak VRAM {vram.peak_gib:.2f} GiB (load, warm-up and requests; llama.cpp's -ngl runs report theirs; "
            f"{held_before:.2f} GiB of it held before the load: the CUDA context, what earlier rows left)")
    graph = getattr(s.gpu, "decode_graph", None)
    out["cuda_graph"] = graph is not None and not graph.disabled
    if graph is not None:
        out["cuda_graph_steps"] = {"replays": graph.replays, "captures": graph.captures, "eager": graph.eager_steps,
                                   "disabled": graph.disabled}
        log(f"  CUDA graph: {out['cuda_graph_steps']}")
    out["rss_after_requests"] = rss = rss_bytes()
    log(f"  resident: anonymous {rss.get('RssAnon', 0) / 2**30:.2f} GiB, file-backed (mmapped weights) "
        f"{rss.get('RssFile', 0) / 2**30:.2f} GiB, pinned {rss.get('RssShmem', 0) / 2**30:.2f} GiB, peak "
        f"{rss.get('VmHWM', 0) / 2**30:.2f} GiB; weights as stored {(plan.memory.cpu_weight_bytes + plan.memory.gpu_weight_bytes) / 2**30:.2f} GiB")
    host_read, gpu_read = read_bytes(s.spec, plan)
    roof_ms = 1e3 * (host_read / (bw["host_read_gbs"] * GB) + gpu_read / (bw["hbm_copy_gbs"] * GB))
    out["decode_fraction_of_roofline"] = roof_ms / out["per_token_ms_p50"]
    out.update({"bundle": bundle, "load_s": load_s, "plan": plan.describe(), "cpu_units": plan.placement.cpu_units,
                "t_plan_ms": plan.predictions.t_plan_ms, "cpu_weight_bytes": plan.memory.cpu_weight_bytes,
                "gpu_weight_bytes": plan.memory.gpu_weight_bytes, "roofline_ms": roof_ms,
                "measured_over_plan": out["per_token_ms_p50"] / plan.predictions.t_plan_ms if plan.predictions.t_plan_ms else None,
                "tokens_first_request": runs[0]["tokens"], "hybrid": plan.placement.is_hybrid})
    if cpu_steps:
        hw = calibrated or HardwareProfile.load(os.path.join(s.bundle_dir, "hardware.json"))
        out.update(cpu_stage_fields(s, plan, cpu_steps, hw))
        log(f"  CPU stage: {out['cpu_stage_ms_p50']:.2f} ms a step, {out['cpu_stage_read_gbs']:.1f} GB/s of its weights; "
            f"the profile's stage read over that {out.get('profile_dram_vs_measured', float('nan')):.3f}, its M's "
            f"{out.get('profile_gemv_read_vs_measured', float('nan')):.3f}")
    if plan.placement.is_hybrid:
        out.update(hybrid_fields(s, plan, out["per_token_ms_p50"], calibrated))
        log(f"  hybrid decode: {out['hybrid_schedule']}; {out['streamed_bytes_per_token'] / 2**20:.1f} MiB/token over "
            f"PCIe ({out['pcie_gbs']:.1f} GB/s), host weights read at {out['host_weight_gbs']:.1f} GB/s"
            + (f", {out['share_of_dram_pcie']:.0%} of the profile's DRAM + PCIe rate" if "share_of_dram_pcie" in out else ""))
    if calibrated is not None:
        from helmc.planner.calibrate import predict_bundle

        c = predict_bundle(s.spec, plan, calibrated, prompt_len=len(prompt), output_len=new_tokens)  # these requests
        out.update({f"t_plan_{label}_ms": c.t_plan_ms, f"t_cpu_{label}_ms": c.t_cpu_ms,
                    f"t_gpu_{label}_ms": c.t_gpu_ms, f"t_comm_{label}_ms": c.t_comm_ms,
                    f"measured_over_plan_{label}": out["per_token_ms_p50"] / c.t_plan_ms})
        log(f"  T_plan ({label}) {c.t_plan_ms:.2f} ms (T_cpu {c.t_cpu_ms:.2f} + T_gpu {c.t_gpu_ms:.2f} + "
            f"T_comm {c.t_comm_ms:.4f}); measured p50 {out['per_token_ms_p50']:.2f} ms, ratio "
            f"{out[f'measured_over_plan_{label}']:.3f}")
    if trace:             # untimed, after every timed figure (time_cpu_stage's list included)
        out.update(trace_fields(s, prompt, new_tokens, runs[0]["tokens"]))
    del s, graph          # every reference gone first (with `graph` kept, the next row's peak read 7.57 GiB)
    free_device_pools()
    return out


def trace_fields(session, prompt: list[int], n: int, request_tokens: list[int]) -> dict:
    """A row's greedy trace (JSON) and whether its tokens are the timed first request's (the same argmax rule)."""
    t = greedy_trace(session, prompt, n)
    return {"greedy_trace": t.to_json(), "greedy_trace_equals_request": list(t.tokens) == list(request_tokens)}


def compare_rows(hybrid_row: dict, split_row: dict) -> dict:
    """compare_greedy over two rows' traces (trace_fields): tokens_equal_split, where they part, and if at a tie."""
    a, b = (GreedyTrace(**{k: tuple(v) for k, v in r["greedy_trace"].items()}) for r in (hybrid_row, split_row))
    return compare_greedy(a, b)


def time_cpu_stage(s) -> list[float] | None:
    """From here on, the seconds of each decode step a split's CPU stage runs (not a hybrid's: its CPU groups
    interleave with copies); None where there is no such stage."""
    gpu, steps = s.gpu, []
    if gpu is None or gpu.cpu_stage_step is None or s.plan.placement.is_hybrid:
        return None
    inner = gpu.cpu_stage_step

    def timed(x, cos, sin, phase):
        t = time.perf_counter()
        out = inner(x, cos, sin, phase)
        if phase == "decode":
            steps.append(time.perf_counter() - t)
        return out
    gpu.cpu_stage_step = timed
    return steps


# ---- Hugging Face peers ------------------------------------------------------------------------
def bench_hf(model_dir: str, prompt: list[int], new_tokens: int, requests: int, max_memory: dict | None,
             keep_scores: bool = False, device: str = "cuda") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class Stamps(StoppingCriteria):
        """Called once per generated token (the first right after prefill): a timestamp each."""
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores, **kwargs):
            if device != "cpu":
                torch.cuda.synchronize()
            self.t.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    t = time.perf_counter()
    if max_memory is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16, device_map="auto",
                                                     max_memory=max_memory)
    model.eval()
    load_s = time.perf_counter() - t
    placement = getattr(model, "hf_device_map", None) or {"": device}
    on_cpu = sum(1 for v in placement.values() if str(v) in ("cpu", "disk"))
    log(f"HF {'accelerate' if max_memory else 'whole GPU'}: loaded in {load_s:.1f} s, {on_cpu} of {len(placement)} modules on CPU")
    ids = torch.tensor([prompt], device="cuda:0" if device == "cuda" else device)
    gen = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)

    def one(n, scores=False):
        st = Stamps()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **{**gen, "min_new_tokens": n, "max_new_tokens": n},
                                 stopping_criteria=StoppingCriteriaList([st]),
                                 output_scores=scores, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        per = [1e3 * (b - a) for a, b in zip(st.t, st.t[1:])]
        dec = (len(st.t) - 1) / (st.t[-1] - st.t[0]) if len(st.t) > 1 else 0.0
        r = {"tokens": tokens, "ttft_ms": 1e3 * (st.t[0] - t0), "decode_tok_s": dec, "per_token_ms": per}
        if scores:
            r["top5"] = [torch.topk(sc[0].float(), 5).indices.tolist() for sc in out.scores]
        return r

    one(4)                                                                                   # warm-up
    runs = []
    for i in range(requests):
        runs.append(one(new_tokens, scores=keep_scores and i == 0))
        log(f"  request {i}: TTFT {runs[-1]['ttft_ms']:.1f} ms, {runs[-1]['decode_tok_s']:.2f} tok/s")
    out = summarize(runs)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out.update({"load_s": load_s, "modules_on_cpu": on_cpu, "modules": len(placement), "weight_bytes": weight_bytes,
                "tokens_first_request": runs[0]["tokens"]})
    if keep_scores:
        out["top5_first_request"] = runs[0]["top5"]
    del model
    if device != "cpu":
        free_device_pools()
    return out


def compare_tokens(ours: list[int], ref: list[int], ref_top5: list[list[int]] | None) -> dict:
    n = min(len(ours), len(ref))
    first = next((i for i in range(n) if ours[i] != ref[i]), None)
    out = {"compared": n, "identical": first is None, "first_divergence": first}
    if first is not None and ref_top5 is not None:
        out["ours_in_ref_top5_at_divergence"] = ours[first] in ref_top5[first]
    return out


def run_calibration(a, report: dict):
    """helmc calibrate over the bundles on this machine; returns the calibrated HardwareProfile."""
    from helmc.planner.calibrate import calibrate

    hardware = a.hardware or os.path.join(a.bundle[0], "hardware.json")
    t = time.perf_counter()
    r = calibrate(a.bundle, hardware, weights_dir=a.model, steps=a.calibrate_steps)
    report["calibration"] = dict(r.to_json_dict(), hardware=hardware, seconds=time.perf_counter() - t)
    log(f"calibration ({time.perf_counter() - t:.1f} s) against {hardware}:\n{r.summary()}")
    if a.out:
        path = os.path.splitext(a.out)[0] + "-calibrated-hardware.json"
        r.profile.save(path)
        report["calibration"]["profile_path"] = path
    free_device_pools()
    return r.profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (weights for helmc and the peers)")
    ap.add_argument("--bundle", action="append", default=[], help="helmc bundle (repeatable: split, all-GPU, ...)")
    ap.add_argument("--gpu-budget", type=float, default=7.0, help="GiB of GPU memory for Accelerate's max_memory")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--peer-requests", type=int, default=3, help="requests for HF on the whole GPU")
    ap.add_argument("--accelerate-requests", type=int, default=1)
    ap.add_argument("--accelerate-new-tokens", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma-separated: accelerate, hf_gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate", action="store_true",
                    help="run helmc calibrate on the bundles first and report T_plan (calibrated) per bundle")
    ap.add_argument("--hardware", default=None,
                    help="profile to calibrate (default: the first bundle's hardware.json)")
    ap.add_argument("--profile", default=None,
                    help="a profile measured in this run (`helmc profile`): each row also reports T_plan of its "
                         "bundle's placement under it and measured / that, with no calibration step")
    ap.add_argument("--replan", action="store_true",
                    help="with --profile: run each bundle with its plan made again from that profile (helmc plan "
                         "BUNDLE hardware.json; the bundle's workload and VRAM budget, no compiling)")
    ap.add_argument("--calibrate-steps", type=int, default=None, help="decode steps timed per device (default: the plan's)")
    ap.add_argument("--variants", default="",
                    help="with --replan, comma-separated: split (each bundle's plain split in its budget too: the "
                         "profile's DRAM against its CPU stage, and the hybrid's tokens against it), all_gpu (the "
                         "same bundle planned for the whole GPU)")
    llamacpp_peer.add_arguments(ap)
    ap.add_argument("--eager-too", action="store_true",
                    help="also run each bundle with a GPU stage without CUDA graphs (same tokens expected)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default=None, help="what the model is, for benchmarks/make_table.py (default: --model's file name)")
    a = ap.parse_args(argv)
    if a.replan and not a.profile:
        ap.error("--replan expected with --profile (the profile to plan from), found it alone")
    variants = set(filter(None, a.variants.split(",")))
    if variants - {"split", "all_gpu"} or (variants and not a.replan):
        ap.error(f"--variants expected split and/or all_gpu, with --replan; found {a.variants!r}"
                 f"{'' if a.replan else ' without --replan'}")
    # Before torch or the runtime makes this process's CUDA context, so helmc's peak VRAM counts that context as
    # llama.cpp's figure counts its own.
    vram_baseline_mib = gpu_memory_used_mib()
    skip = set(filter(None, a.skip.split(",")))

    from helmc.model.load import is_gguf, load_spec
    vocab = load_spec(a.model).vocab_size
    if is_gguf(a.model):
        skip |= {"hf_gpu", "accelerate"}       # no Hugging Face directory: llama.cpp is the peer
    prompt = np.random.default_rng(a.seed).integers(3, vocab, a.prompt_len).tolist()
    report = {"label": a.label or os.path.basename(os.path.normpath(a.model)),
              "command": "python -m benchmarks.bench_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": a.model, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "gpu_budget_gib": a.gpu_budget,
              "requests": a.requests, "helmc": []}

    def save():
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(report, f, indent=2)
            os.replace(a.out + ".tmp", a.out)

    import torch

    report["device"] = torch.cuda.get_device_name(0)
    report["bandwidth"] = bw = measure_bandwidths()
    log(f"bandwidth: host {bw['host_read_gbs']:.1f} GB/s, HBM copy {bw['hbm_copy_gbs']:.0f} GB/s, "
        f"pinned H2D {bw['h2d_pinned_gbs']:.1f} GB/s")
    save()
    calibrated, label = None, "calibrated"
    if a.calibrate and a.bundle:
        calibrated = run_calibration(a, report)
        save()
    elif a.profile:       # this run's own `helmc profile`: the plan's time for each bundle's placement, no calibration
        calibrated, label = HardwareProfile.load(a.profile), "profile"
        report["profile_path"] = a.profile
    for bundle in a.bundle:
        # --replan: what a user does on a new machine (helmc profile, helmc plan BUNDLE, helmc run --plan)
        plan = replan_bundle(bundle, calibrated)[0] if a.replan else None
        main_row = bench_helmc(bundle, a.model, prompt, a.new_tokens, a.requests, bw, calibrated, label=label, plan=plan,
                               vram_baseline_mib=vram_baseline_mib, trace="split" in variants and bool(plan and plan.placement.is_hybrid)
                               ) | {"replanned": plan is not None}
        report["helmc"].append(main_row)
        save()
        # The split before the all-GPU run: the other way round, the 7 GiB split read 20.39 GiB of peak
        # VRAM, the memory the all-GPU bundle left held on the device.
        for variant in (v for v in ("split", "all_gpu") if v in variants):
            # the same bundle, another placement (no compiling): the split in the same budget, or the whole GPU
            vplan = (replan_bundle(bundle, calibrated, hybrid=False)[0] if variant == "split" else
                     replan_bundle(bundle, calibrated, gpu_budget_gib=calibrated.gpu.vram_total_bytes / 2**30)[0])
            if vplan.describe() == plan.describe():
                continue
            row = bench_helmc(bundle, a.model, prompt, a.new_tokens, a.requests, bw, calibrated, label=label, plan=vplan,
                              vram_baseline_mib=vram_baseline_mib, trace=variant == "split" and main_row["hybrid"])
            row |= {"replanned": True, "variant": variant}
            report["helmc"].append(row)
            if variant == "split" and main_row["hybrid"]:
                main_row.update(compare_rows(main_row, row))
                log(f"  hybrid and plain split: the same greedy tokens: {main_row['tokens_equal_split']} (first "
                    f"divergence {main_row['tokens_first_divergence_vs_split']}, at a tie: "
                    f"{main_row.get('tokens_divergence_at_tie', '-')})")
            save()
        if a.eager_too and report["helmc"][-1].get("cuda_graph"):
            eager = bench_helmc(bundle, a.model, prompt, a.new_tokens, a.requests, bw, calibrated, cuda_graph=False,
                                label=label, vram_baseline_mib=vram_baseline_mib)
            graphed = report["helmc"][-1]
            graphed["tokens_equal_without_graph"] = eager["tokens_first_request"] == graphed["tokens_first_request"]
            graphed["speedup_over_no_graph"] = graphed["decode_tok_s_p50"] / eager["decode_tok_s_p50"]
            log(f"  without CUDA graphs: {eager['decode_tok_s_p50']:.2f} tok/s; graph speedup "
                f"{graphed['speedup_over_no_graph']:.2f}x, same tokens: {graphed['tokens_equal_without_graph']}")
            report["helmc"].append(eager)
            save()
    if a.llama_bench:
        report["llamacpp"] = []
        for r in llamacpp_peer.bench_each_ngl(a):
            log(llamacpp_peer.describe(r))
            report["llamacpp"].append(r)
            save()
        for h in report["helmc"]:
            h.update(llamacpp_peer.ratios(h, report["llamacpp"], a.prompt_len))
        save()
    if "hf_gpu" not in skip:
        report["hf_gpu"] = bench_hf(a.model, prompt, a.new_tokens, a.peer_requests, None, keep_scores=True)
        for h in report["helmc"]:
            h["vs_hf_gpu_tokens"] = compare_tokens(h["tokens_first_request"], report["hf_gpu"]["tokens_first_request"],
                                                   report["hf_gpu"].get("top5_first_request"))
        save()
    if "accelerate" not in skip:
        report["accelerate"] = bench_hf(a.model, prompt, a.accelerate_new_tokens, a.accelerate_requests,
                                        {0: f"{a.gpu_budget:g}GiB", "cpu": "100GiB"})
        save()
    print(f"\n| system | plan | decode tok/s | TTFT ms | p50 per token ms | T_plan ms | T_plan ({label}) ms | "
          f"measured/plan ({label}) | roofline ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for h in report["helmc"]:
        cal = (f"{h[f't_plan_{label}_ms']:.1f} | {h[f'measured_over_plan_{label}']:.3f}"
               if f"t_plan_{label}_ms" in h else "- | -")
        graph = "" if h.get("cuda_graph", True) else " (no graph)"
        vram = f" ({h['peak_vram_gib']:.2f} GiB VRAM)" if h.get("peak_vram_gib") is not None else ""
        print(f"| helmc {os.path.basename(h['bundle'].rstrip('/'))}{graph} | {h['plan']}{vram} | {h['decode_tok_s_p50']:.2f} | "
              f"{h['ttft_ms_p50']:.0f} | {h['per_token_ms_p50']:.1f} | {h['t_plan_ms']:.1f} | {cal} | {h['roofline_ms']:.1f} |")
    for r in report.get("llamacpp", []):
        vram = f" ({r['peak_vram_gib']:.2f} GiB VRAM)" if r.get("peak_vram_gib") is not None else ""
        print(f"| llama.cpp | -ngl {r['ngl']}{vram} | {r['decode_tok_s_p50']:.2f} | {r['ttft_ms_p50']:.0f} | "
              f"{r['per_token_ms_p50']:.1f} | - | - | - | - |")
    for h in report["helmc"]:
        for k, v in h.items():
            if k.startswith(("decode_ratio_vs_llamacpp", "ttft_ratio_vs_llamacpp", "hybrid_decode_ratio",
                             "llamacpp_ngl_within", "helmc_within_budget")):
                shown = f"{v:.3f}" if isinstance(v, float) else v        # an -ngl, or None: no VRAM figure or fit
                print(f"helmc {h['plan']}{'' if h.get('cuda_graph', True) else ' (no graph)'}: {k} = {shown}")
    for key, label in (("accelerate", f"HF Accelerate ({a.gpu_budget:g} GiB)"), ("hf_gpu", "HF whole GPU")):
        if key in report:
            r = report[key]
            print(f"| {label} | {r['modules_on_cpu']}/{r['modules']} modules on CPU | {r['decode_tok_s_p50']:.2f} | "
                  f"{r['ttft_ms_p50']:.0f} | {r['per_token_ms_p50']:.1f} | - | - | - | - |")
    for h in report["helmc"]:
        if f"measured_over_plan_{label}" in h:
            r = h[f"measured_over_plan_{label}"]
            print(f"helmc {h['plan']}: measured {h['per_token_ms_p50']:.2f} ms/token vs T_plan ({label}) "
                  f"{h[f't_plan_{label}_ms']:.2f} ms: ratio {r:.3f} ({'within' if abs(r - 1) <= 0.15 else 'outside'} 15%)")
    if "accelerate" in report:
        for h in report["helmc"]:
            h["speedup_vs_accelerate"] = h["decode_tok_s_p50"] / report["accelerate"]["decode_tok_s_p50"]
            print(f"helmc {h['plan']}: {h['speedup_vs_accelerate']:.1f}x Accelerate's decode tok/s; "
                  f"measured/plan per token {h['measured_over_plan']:.2f}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
