#!/usr/bin/env python3
"""One Qwen3 block (default 8B) on the CPU stage: decode step against the roofline, prefill against torch bf16.

The block is the pipeline's own export (helmc.compiler.passes.export_block: pre_attn + post_attn, weights as graph inputs),
imported to Relax and compiled with helmc.compiler.passes.schedule_cpu_stage.compile_cpu_stage. Attention itself is not in
these functions (the runtime drives it between them), so the attention output is a random input here.

  decode   pre_attn_decode + post_attn_decode, one token, cycling through enough weight copies to read
           >= 4x L3 per pass; compared with W_param / DRAM bandwidth measured in the same run
           (thesis 4.1.5's roofline; the issue asks for <= 1.25x). The weight copies and the DRAM read
           share one allocation (bench_cpu_gemv.WeightArena), so the roofline is measured on their pages.
  prefill  pre_attn_prefill + post_attn_prefill on a 128-token prompt, against the same block in torch
           with bf16 weights and activations (torch's bf16 CPU path), same thread count, reading the same
           weight memory as helmc's prefill.
Numerics: both variants against torch in float32 on the same weights. On an AMX target with bf16 weights the
prefill GEMMs take bf16-rounded activations (the model's precision, as HF's bf16 linears; gemm_amx.py), so
the prefill reference rounds each linear's input to bf16 too; the error against the unrounded fp32 block and
torch bf16's own error against it are reported beside it. --amx-activations fp32 builds the hi + lo kernels (helmc build --prefill-activations).

  python -m benchmarks.bench_cpu_block [--json]                                  # build and run here
  python -m benchmarks.bench_cpu_block --build-only DIR --hardware hw.json      # compile for another CPU
  python -m benchmarks.bench_cpu_block --run-only DIR [--json]                  # there: tvm.runtime + torch only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

MANIFEST = "block_bench.json"
# Pause before every timed section: torch's and TVM's worker threads keep spinning for a while after their
# last parallel region, and on a machine with few cores that spinning slowed the next system's section
# (measured on the 2-core EPYC: helmc's decode step 16.9 ms right after a torch op, 13.8 ms after 0.3 s).
SETTLE_S = 0.3
NUMERICS_LIMIT = 1e-3   # max |diff| / max |ref| against torch in float32 (the bound for 16-bit weights)
# Qwen3 config.json values (published on the Hub) that the block depends on.
QWEN3_CONFIGS = {
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32},
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32},
    "14b": {"hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 40},
}


def qwen3_spec(model: str, dtype: str, **overrides):
    from helmc.model.spec import ModelSpec
    cfg = {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "num_key_value_heads": 8, "vocab_size": 151936,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "num_hidden_layers": 36,
           "torch_dtype": dtype, "attention_bias": False, "tie_word_embeddings": False,
           **QWEN3_CONFIGS[model], **overrides}
    return ModelSpec.from_hf_config(cfg, f"Qwen3-{model.upper()}")


def build(out_dir: str, spec, features: tuple[str, ...], min_read_bytes: int, amx_blocking: str = "auto",
          amx_activations: str = "model", gemv_prefetch: int | None = None) -> None:
    import tvm
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.passes.schedule_cpu_stage import compile_cpu_stage, llvm_target, required_cpu_features
    from helmc.schedules.cpu import gemm_amx
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements

    # Benchmark-only switch: "auto" keeps the compiler's per-shape choice (gemm_amx.blocking_for); a variant
    # name builds every AMX GEMM with that blocking.
    gemm_amx.BLOCKING_OVERRIDE = None if amx_blocking == "auto" else gemm_amx.blocking_named(amx_blocking)
    from helmc.schedules.cpu import gemv as gemv_module
    if gemv_prefetch is not None:   # benchmark-only switch (schedules/cpu/gemv.py)
        gemv_module.PREFETCH_STEPS = gemv_prefetch
    gemv_prefetch = gemv_module.PREFETCH_STEPS
    exported = tuple(f for f in export_functions(spec) if f.name in ("pre_attn", "post_attn"))
    mod = import_functions(exported)
    os.makedirs(out_dir, exist_ok=True)
    compile_cpu_stage(mod, features, prefill_activations=amx_activations).export_library(os.path.join(out_dir, "block.so"))
    isa = select_isa(features)
    elements = stream_read_elements(min_read_bytes, isa)
    tvm.compile(make_stream_read(elements, isa), target=llvm_target(features)).export_library(
        os.path.join(out_dir, "stream_read.so"))
    manifest = {"spec": json.loads(spec.to_json()), "required_flags": list(required_cpu_features(features)),
                "isa": isa.tier, "amx_blocking": amx_blocking, "read_elements": elements,
                "amx_activations": amx_activations if isa.has_amx_bf16 else None, "gemv_prefetch": gemv_prefetch,
                "inputs": {f.name: list(f.input_names) for f in exported},
                "weights": {f.name: list(f.weight_names) for f in exported}}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def torch_block(spec, act, round_linear_inputs=None):
    """pre(x, cos, sin, w) and post(x, attn, w) in torch, HF Qwen3 semantics, activations in `act`;
    round_linear_inputs (a torch dtype): every linear's input rounded to it first (an fp32 block whose GEMMs
    read bf16 activations, what helmc's AMX prefill computes)."""
    import torch
    import torch.nn.functional as F
    D, eps = spec.head_dim, spec.rms_norm_eps

    def linear(t, w):
        return F.linear(t if round_linear_inputs is None else t.to(round_linear_inputs).to(t.dtype), w)

    def rms(t, w):
        t32 = t.to(torch.float32)
        return w * (t32 * torch.rsqrt((t32 * t32).mean(-1, keepdim=True) + eps)).to(act)

    def rot(t):
        return torch.cat([-t[..., D // 2:], t[..., :D // 2]], dim=-1)

    def pre(x, cos, sin, w):
        S = x.shape[0]
        h = rms(x, w["input_layernorm.weight"])
        q = linear(h, w["self_attn.q_proj.weight"]).reshape(S, spec.num_heads, D)     # [S, Q] -> [S, h, D]
        k = linear(h, w["self_attn.k_proj.weight"]).reshape(S, spec.num_kv_heads, D)  # [S, KV] -> [S, h_kv, D]
        v = linear(h, w["self_attn.v_proj.weight"]).reshape(S, spec.num_kv_heads, D)  # [S, KV] -> [S, h_kv, D]
        q, k = rms(q, w["self_attn.q_norm.weight"]), rms(k, w["self_attn.k_norm.weight"])
        c, s = cos[:, None, :].to(act), sin[:, None, :].to(act)                           # [S, D] -> [S, 1, D]
        return q * c + rot(q) * s, k * c + rot(k) * s, v

    def post(x, attn, w):
        h = x + linear(attn, w["self_attn.o_proj.weight"])
        m = rms(h, w["post_attention_layernorm.weight"])
        g = linear(m, w["mlp.gate_proj.weight"])
        return h + linear(F.silu(g) * linear(m, w["mlp.up_proj.weight"]), w["mlp.down_proj.weight"])

    return pre, post


def run(out_dir: str, threads: int, rounds: int, prompt: int, huge_pages: bool = False) -> dict:
    import numpy as np
    import torch
    import tvm.runtime
    from tvm.runtime.vm import VirtualMachine
    from helmc.model.spec import ModelSpec
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, tensor_from_numpy

    from benchmarks.bench_cpu_gemv import WeightArena, arena_bytes, cpu_flags, l3_bytes
    from helmc.runtime.weights.host_memory import anon_huge_page_bytes, cpu_tensor_over

    manifest = json.load(open(os.path.join(out_dir, MANIFEST)))
    lacking = [f for f in manifest["required_flags"] if f not in cpu_flags()]
    if lacking:
        sys.exit(f"bench_cpu_block: the compiled block needs CPU flags {lacking} that this CPU lacks")
    spec = ModelSpec.from_json(json.dumps(manifest["spec"]))
    torch.set_num_threads(threads)
    dev = tvm.runtime.cpu()
    vm = VirtualMachine(tvm.runtime.load_module(os.path.join(out_dir, "block.so")), dev)
    reader = tvm.runtime.load_module(os.path.join(out_dir, "stream_read.so"))["helmc_stream_read"]
    shapes = spec.block_weight_shapes()
    names = manifest["weights"]["pre_attn"] + manifest["weights"]["post_attn"]
    rng = np.random.default_rng(0)
    tdt = getattr(torch, spec.dtype)

    host = {}
    for name in names:
        shape = shapes[name]
        vals = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)) if len(shape) == 1 else \
            rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])
        host[name] = bf16_bits_from_float32(vals) if spec.dtype == "bfloat16" else vals.astype(spec.dtype)
    w_param = sum(a.nbytes for a in host.values())
    copies = max(1, -(-4 * l3_bytes() // w_param))
    read_n = manifest["read_elements"]
    # The weight sets and the DRAM read share one allocation (bench_cpu_gemv.WeightArena): the roofline's
    # read streams the pages the decode step streams.
    arena = WeightArena(arena_bytes(read_n * 4, [copies * (w_param + len(names) * WeightArena.ALIGN)]), huge_pages)
    weight_sets = [{n: arena.place(a, spec.dtype) for n, a in host.items()} for _ in range(copies)]
    # torch reads the first set, the one helmc's prefill reads: the same pages.
    torch_w = {n: torch.from_dlpack(t) for n, t in weight_sets[0].items()}
    torch_w32 = {n: t.to(torch.float32) for n, t in torch_w.items()}

    H, D, Q = spec.hidden_size, spec.head_dim, spec.q_dim

    def acts(seq):
        pos = np.arange(seq, dtype=np.float64)[:, None]
        inv = spec.rope.theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
        ang = np.concatenate([pos * inv, pos * inv], axis=1)
        return (rng.standard_normal((seq, H), dtype=np.float32), np.cos(ang).astype(np.float32),
                np.sin(ang).astype(np.float32), rng.standard_normal((seq, Q), dtype=np.float32))

    def helmc_step(kind, a, ws):
        x, cos, sin, attn = a
        q, k, v = vm[f"pre_attn_{kind}"](x, cos, sin, *[ws[n] for n in manifest["weights"]["pre_attn"]])
        y = vm[f"post_attn_{kind}"](x, attn, *[ws[n] for n in manifest["weights"]["post_attn"]])
        return q, k, v, y

    pre_t, post_t = torch_block(spec, torch.float32)
    bf16_inputs = manifest.get("amx_activations") == "model" and spec.dtype == "bfloat16"
    pre_r, post_r = torch_block(spec, torch.float32, torch.bfloat16) if bf16_inputs else (pre_t, post_t)
    pre_bf, post_bf = torch_block(spec, torch.bfloat16)
    torch_w_bf = {n: t.to(torch.bfloat16) for n, t in torch_w.items()}
    report = {"threads": threads, "w_param_bytes": w_param, "weight_copies": copies, "prompt": prompt,
              "amx_blocking": manifest.get("amx_blocking"), "amx_activations": manifest.get("amx_activations"),
              "model": f"{spec.hidden_size}h/{spec.intermediate_size}ffn", "dtype": spec.dtype,
              "huge_pages": huge_pages, "anon_huge_page_bytes": anon_huge_page_bytes()}
    for kind, seq in (("decode", 1), ("prefill", prompt)):
        a = acts(seq)
        ta = [tensor_from_numpy(v, "float32", dev) for v in a]
        outs = helmc_step(kind, ta, weight_sets[0])
        tx = [torch.from_numpy(v) for v in a]
        with torch.no_grad():
            ref = list(pre_t(tx[0], tx[1], tx[2], torch_w32)) + [post_t(tx[0], tx[3], torch_w32)]
            contract = ref if kind == "decode" else \
                list(pre_r(tx[0], tx[1], tx[2], torch_w32)) + [post_r(tx[0], tx[3], torch_w32)]
            bf = [v.float() for v in pre_bf(*[v.to(torch.bfloat16) for v in tx[:3]], torch_w_bf)] + \
                [post_bf(tx[0].to(torch.bfloat16), tx[3].to(torch.bfloat16), torch_w_bf).float()]

        def rel(outs_, ref_):
            return max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(outs_, ref_))
        got = [torch.from_numpy(o.numpy()) for o in outs]
        report[f"{kind}_rel_err"] = rel(got, contract)          # the kernels' contract (see the docstring)
        report[f"{kind}_rel_err_fp32"] = rel(got, ref)          # against the unrounded fp32 block
        report[f"torch_bf16_{kind}_rel_err_fp32"] = rel(bf, ref)

    buf = cpu_tensor_over(arena.region, (read_n,), "float32")
    part = tvm.runtime.empty((1024,), "float32", dev)
    tbuf = torch.from_dlpack(buf)
    reader(buf, part)
    dec_a = [tensor_from_numpy(v, "float32", dev) for v in acts(1)]
    pre_a = [tensor_from_numpy(v, "float32", dev) for v in acts(prompt)]
    # torch's CPU path in the block's dtype, and in bf16 too when the block is fp16 (the reference).
    torch_dtypes = [spec.dtype] + (["bfloat16"] if spec.dtype != "bfloat16" else [])
    torch_ws = {d: (torch_w if d == spec.dtype else {n: t.to(getattr(torch, d)) for n, t in torch_w.items()})
                for d in torch_dtypes}
    tpre = {d: [torch.from_numpy(v).to(getattr(torch, d)) for v in acts(prompt)] for d in torch_dtypes}
    tdec = [torch.from_numpy(v).to(tdt) for v in acts(1)]
    pre_b, post_b = torch_block(spec, tdt)
    blocks_b = {d: torch_block(spec, getattr(torch, d)) for d in torch_dtypes}
    times = {key: [] for key in ("dram", "decode", "decode_pre", "decode_post", "prefill", "torch_decode")
             + tuple(f"torch_{d}_prefill" for d in torch_dtypes)}

    def timed(key, fn, per=1):
        time.sleep(SETTLE_S)
        t = time.perf_counter()
        fn()
        times[key].append((time.perf_counter() - t) * 1e3 / per)

    def decode_phase(which):
        for ws in weight_sets:
            x, cos, sin, attn = dec_a
            if which == "pre":
                vm["pre_attn_decode"](x, cos, sin, *[ws[n] for n in manifest["weights"]["pre_attn"]])
            else:
                vm["post_attn_decode"](x, attn, *[ws[n] for n in manifest["weights"]["post_attn"]])

    for _ in range(rounds):  # interleaved, so every figure sees the same background load
        for fn in (lambda: reader(buf, part), lambda: tbuf.sum()):
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            fn()
            times["dram"].append(read_n * 4 / (time.perf_counter() - t) / 1e9)
        timed("decode", lambda: [helmc_step("decode", dec_a, ws) for ws in weight_sets], copies)
        timed("decode_pre", lambda: decode_phase("pre"), copies)
        timed("decode_post", lambda: decode_phase("post"), copies)
        timed("prefill", lambda: helmc_step("prefill", pre_a, weight_sets[0]))
        with torch.no_grad():
            for d in torch_dtypes:
                pb, qb = blocks_b[d]
                a = tpre[d]
                timed(f"torch_{d}_prefill", lambda: (pb(a[0], a[1], a[2], torch_ws[d]), qb(a[0], a[3], torch_ws[d])))
            timed("torch_decode", lambda: (pre_b(tdec[0], tdec[1], tdec[2], torch_w), post_b(tdec[0], tdec[3], torch_w)))
    med = {k: float(np.median(v)) for k, v in times.items()}
    best = {k: (max(v) if k == "dram" else min(v)) for k, v in times.items()}
    dram = best["dram"]
    roof_ms = w_param / (dram * 1e9) * 1e3
    dec_ms, pre_ms = best["decode"], best["prefill"]
    torch_bf16 = best["torch_bfloat16_prefill"]
    report.update({"rounds": rounds, "statistic": "best of rounds (median in *_median)",
                   "dram_gbs": round(dram, 2), "decode_ms": round(dec_ms, 3), "roofline_ms": round(roof_ms, 3),
                   "decode_over_roofline": round(dec_ms / roof_ms, 3),
                   "decode_gbs": round(w_param / dec_ms / 1e6, 2),
                   "decode_pre_attn_ms": round(best["decode_pre"], 3), "decode_post_attn_ms": round(best["decode_post"], 3),
                   "torch_decode_ms": round(best["torch_decode"], 3),
                   "prefill_ms": round(pre_ms, 2), "torch_prefill_ms": round(best[f"torch_{spec.dtype}_prefill"], 2),
                   "torch_bf16_prefill_ms": round(torch_bf16, 2),
                   "prefill_speedup_vs_torch": round(best[f"torch_{spec.dtype}_prefill"] / pre_ms, 3),
                   "prefill_speedup_vs_torch_bf16": round(torch_bf16 / pre_ms, 3),
                   "dram_gbs_median": round(med["dram"], 2), "decode_ms_median": round(med["decode"], 3),
                   "decode_over_roofline_median": round(med["decode"] / (w_param / (med["dram"] * 1e9) * 1e3), 3),
                   "prefill_ms_median": round(med["prefill"], 2),
                   "torch_bf16_prefill_ms_median": round(med["torch_bfloat16_prefill"], 2)})
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=sorted(QWEN3_CONFIGS))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build-only", metavar="DIR")
    ap.add_argument("--run-only", metavar="DIR")
    ap.add_argument("--hardware", help="hardware.json whose CPU features to compile for (default: this CPU)")
    ap.add_argument("--features", help="comma list of /proc/cpuinfo flags to compile for")
    ap.add_argument("--l3-bytes", type=int, help="size the DRAM read for this L3 (default: the target's)")
    ap.add_argument("--threads", type=int, default=0, help="default: every core this process may use")
    # 10 interleaved rounds: the GPU machine's DRAM figure varies 155-180 GB/s best, lower medians.
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gemv-prefetch", type=int, default=None,
                    help="build the GEMVs with software prefetch this many K steps ahead, 0 for none "
                         "(default: gemv.PREFETCH_STEPS)")
    ap.add_argument("--huge-pages", action="store_true", help="weights in MADV_HUGEPAGE memory (runtime/weights/host_memory.py)")
    ap.add_argument("--amx-activations", default="model", choices=("model", "fp32"),
                    help="AMX prefill GEMMs on bf16 weights: activations rounded to bf16 (model, the default) or "
                         "split into bf16 hi + lo (two products per tile, ~16 bits)")
    ap.add_argument("--amx-blocking", default="auto",
                    help="build the block's AMX prefill GEMMs with this gemm_amx.BLOCKING_VARIANTS entry "
                         "(auto: the compiler's per-shape choice, gemm_amx.blocking_for)")
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(threads)  # TVM's default is half the cores on x86
    from benchmarks.bench_cpu_gemv import target_features
    if args.run_only:
        out_dir = args.run_only
    else:
        features, target_l3 = target_features(args)
        out_dir = args.build_only or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"helmc_block_bench_{os.getpid()}")
        t = time.time()
        build(out_dir, qwen3_spec(args.model, args.dtype), features, 4 * (args.l3_bytes or target_l3),
              args.amx_blocking, args.amx_activations, args.gemv_prefetch)
        print(f"built {out_dir} in {time.time() - t:.0f} s", file=sys.stderr)
        if args.build_only:
            print(f"run there with  python -m benchmarks.bench_cpu_block --run-only {out_dir}")
            return
    r = run(out_dir, threads, args.rounds, args.prompt, args.huge_pages)
    if args.json:
        print(json.dumps(r))
        sys.exit(0 if max(r["decode_rel_err"], r["prefill_rel_err"]) <= NUMERICS_LIMIT else 1)
    print(f"Qwen3 block {r['model']}, {r['dtype']} weights, W_param {r['w_param_bytes'] / 1e6:.0f} MB, "
          f"{r['threads']} threads, DRAM {r['dram_gbs']:.1f} GB/s; best of {r['rounds']} interleaved rounds; "
          f"AMX blocking {r['amx_blocking']}, activations {r['amx_activations']}; huge pages "
          f"{'asked' if r['huge_pages'] else 'not asked'}, {r['anon_huge_page_bytes'] >> 20} MiB on them")
    print(f"decode step   {r['decode_ms']:.2f} ms = {r['decode_gbs']:.1f} GB/s; roofline {r['roofline_ms']:.2f} ms "
          f"-> {r['decode_over_roofline']:.2f}x (target <= 1.25x); torch {r['dtype']} {r['torch_decode_ms']:.2f} ms")
    print(f"  (pre_attn {r['decode_pre_attn_ms']:.2f} ms + post_attn {r['decode_post_attn_ms']:.2f} ms; medians: "
          f"step {r['decode_ms_median']:.2f} ms, DRAM {r['dram_gbs_median']:.1f} GB/s -> "
          f"{r['decode_over_roofline_median']:.2f}x)")
    print(f"prefill {r['prompt']}   {r['prefill_ms']:.1f} ms; torch {r['dtype']} {r['torch_prefill_ms']:.1f} ms "
          f"-> {r['prefill_speedup_vs_torch']:.2f}x; torch bfloat16 {r['torch_bf16_prefill_ms']:.1f} ms "
          f"-> {r['prefill_speedup_vs_torch_bf16']:.2f}x")
    ok = max(r["decode_rel_err"], r["prefill_rel_err"]) <= NUMERICS_LIMIT
    print(f"numerics vs torch fp32: decode {r['decode_rel_err']:.1e}, prefill {r['prefill_rel_err']:.1e} "
          f"(limit {NUMERICS_LIMIT:.0e}: {'ok' if ok else 'FAIL'}); against the unrounded fp32 block: prefill "
          f"{r['prefill_rel_err_fp32']:.1e}, torch bf16 {r['torch_bf16_prefill_rel_err_fp32']:.1e}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
