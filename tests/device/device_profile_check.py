#!/usr/bin/env python3
"""`helmc profile` on the GPU machine (issue 17), with a profile kit built here, then plans from what it measured.

Three modes:

  --target-out FILE   (GPU machine) writes what a kit for this machine is compiled for: CPU flags, cores, L3, the
      GPU's arch (a small JSON; needs no kit and no compiler), for --build --target FILE here.

  DIR --build [--hardware PRESET_OR_JSON | --target FILE] [--quick]   (here, with the compiler venv and nvcc) builds
      the profile kit for that machine (default the h100-sxm-measured preset: the GPU machine's /proc/cpuinfo flags,
      16 cores, 300 MiB L3, sm_90): helmc's stream read, decode GEMVs per weight type and prefill GEMM for its CPU,
      the synthetic Qwen3-8B-block model's CPU stage (LLVM) and GPU stage. ~4 MiB: carry .devrt.

  DIR [--out OUTDIR]   (GPU machine, TVM_USE_RUNTIME_LIB=1, PYTHONPATH=<checkout>:.devrt/site) measures:
      - the CPU: helmc's stream read and fp16/bf16/q8_0/q4_0/q4_k/q6_k decode GEMVs on every core (host_read_gbs is
        the fp16 one, the cost model's M);
      - the GPU and the link: HBM, fp16 matmul, pinned H2D/D2H and latency (CuPy);
      - DRAM + PCIe at once: copies to the GPU while the fp16 GEMVs run on every core, both rates in one window
        (link.h2d_concurrent_gbs, link.cpu_read_concurrent_gbs; their sum is the combined rate);
      - per-block overheads on the synthetic model's compiled CPU and GPU stages (16 decode steps each), and what the
        CPU stage itself read per block, beside host_read_gbs (the issue wants them within 10%);
    then plans Qwen3-8B (fp16, 7 GiB), Qwen3-14B (fp16, 12 GiB) and Qwen3-32B (fp16, 24 GiB) from that profile,
    hybrid and plain, and prints the tables. Writes OUTDIR/hardware.json and OUTDIR/profile_check.json.

On the GPU machine (scripts/device_run.sh sets up the runtime-only TVM; carry [".devrt"]):
    bash scripts/device_run.sh "py=tests/device/device_profile_check.py,.devrt/profile_kit,--out,$OUT/profile"
Exits 1 when a figure the planner needs could not be measured (the report says which).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (_ROOT, os.path.join(_ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

PLANS = (("Qwen3-8B", 7.0), ("Qwen3-14B", 12.0), ("Qwen3-32B", 24.0))


def target_out(path: str) -> int:
    from helmc.hardware.measure import cpu_facts
    from helmc.hardware.measure_gpu import probe_arch
    f = cpu_facts()
    arch, why = probe_arch("cupy")
    t = {"features": list(f.features), "l3_bytes": f.l3_bytes, "cores": f.cores, "gpu_arch": arch}
    with open(path, "w") as fh:
        json.dump(t, fh, indent=1)
    print(f"{path}: {f.name}, {f.cores} cores, L3 {f.l3_bytes >> 20} MiB, GPU {arch or 'none (' + why + ')'}")
    return 0 if arch else 1


def build(kit_dir: str, hardware: str, quick: bool, target_file: str | None = None) -> None:
    from helmc.compiler.profile_kit import KitTarget, build_kit
    from helmc.hardware.profile import load_hardware
    if target_file:
        with open(target_file) as fh:
            t = json.load(fh)
        target = KitTarget(tuple(t["features"]), int(t["l3_bytes"]), int(t["cores"]), t.get("gpu_arch", ""), quick)
    else:
        target = KitTarget.of_profile(load_hardware(hardware), quick=quick)
    t0 = time.perf_counter()
    kit = build_kit(kit_dir, target, progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(kit_dir) for f in fs)
    print(f"built {kit_dir} ({size >> 20} MiB): {kit.isa} kernels for {target.cores} cores, L3 {target.l3_bytes >> 20} "
          f"MiB, GPU stage for {kit.gpu_arch or 'no GPU'}; synthetic block {kit.block.hidden}x{kit.block.ffn}")


def check(kit_dir: str, out_dir: str, gpu_backend: str = "cupy") -> int:
    from helmc.hardware.kit import ProfileKit
    from helmc.hardware.measure import profile as measure
    from helmc.planner.calibrate import apply_fits, clamp_negative_deltas, synthetic_fits
    from helmc.planner.plan_table import format_plan_table
    from helmc.planner.search_partition import plan
    from qwen3_configs import qwen3_spec

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()

    def progress(m):
        print(f"[{time.perf_counter() - t0:7.1f}s] {m}", flush=True)
    kit = ProfileKit.load(kit_dir)
    hw = measure(kit_dir, quick=kit.quick, gpu_backend=gpu_backend, progress=progress)
    fits, note, skipped = synthetic_fits(hw, kit_dir, progress=progress)
    hw = clamp_negative_deltas(apply_fits(hw, fits, note, source=hw.source))
    hw = dataclasses.replace(hw, unmeasured=hw.unmeasured + skipped)
    hw.save(os.path.join(out_dir, "hardware.json"))
    seconds = time.perf_counter() - t0
    from helmc.hardware.host_read import block_bytes
    linear = block_bytes(kit, "float16")
    report = {"seconds": round(seconds, 1), "kit": kit_dir, "cpu": hw.cpu.name, "gpu": hw.gpu.name if hw.gpu else None,
              "dram_gbs": hw.cpu.dram_gbs, "host_read_gbs": hw.cpu.host_read_gbs, "l3_gbs": hw.cpu.l3_gbs,
              "gemv_reads": {r.weight_type + (f"_x{r.rows}" if r.rows > 1 else ""): r.gbs for r in hw.cpu.gemv_reads}, "unmeasured": list(hw.unmeasured)}
    if hw.link is not None:
        l = hw.link
        report.update(h2d_gbs=l.h2d_gbs, d2h_gbs=l.d2h_gbs, latency_us=l.latency_us, hbm_gbs=hw.gpu.hbm_gbs,
                      h2d_concurrent_gbs=l.h2d_concurrent_gbs, cpu_read_concurrent_gbs=l.cpu_read_concurrent_gbs,
                      combined_gbs=round(l.combined_gbs, 2))
    for f in fits:
        per_block = f.measured_step_ms / f.blocks
        entry = {"blocks": f.blocks, "measured_block_ms": round(per_block, 4),
                 "roofline_block_ms": round(f.roofline_step_ms / f.blocks, 4),
                 "block_overhead_ms": round(f.block_overhead_ms, 4), "step_overhead_ms": round(f.step_overhead_ms, 4)}
        if f.device == "cpu":
            # What helmc's own CPU stage read per block (its linears; attention and norms ride along), against the
            # profile's host read: the figure the issue wants within 10% of the stage's.
            entry["stage_read_gbs"] = round(linear / per_block / 1e6, 2)
            entry["host_read_over_stage_read"] = round(hw.cpu.host_read_gbs / entry["stage_read_gbs"], 3)
        report[f"{f.device}_synthetic_stage"] = entry
    plans = []
    for model, budget in PLANS:
        spec = qwen3_spec(model, torch_dtype="float16")
        try:
            p = plan(spec, hw, gpu_budget_gib=budget)
            s = plan(spec, hw, gpu_budget_gib=budget, hybrid=False)
        except Exception as e:                       # the report says which plan failed and why
            plans.append({"model": model, "gpu_budget_gib": budget, "error": f"{type(e).__name__}: {e}"})
            continue
        print(f"\n== {model} fp16, GPU budget {budget} GiB\n{format_plan_table(p, spec)}")
        plans.append({"model": model, "gpu_budget_gib": budget, "plan": p.describe(), "t_plan_ms": round(p.t_plan_ms, 3),
                      "plain": s.describe(), "plain_t_plan_ms": round(s.t_plan_ms, 3),
                      "predicted_hybrid_speedup": round(s.t_plan_ms / p.t_plan_ms, 3),
                      "groups": [[g.kind, g.first_layer, g.num_layers] for g in p.groups],
                      "staging_ring_bytes": p.staging_ring_bytes})
    report["plans"] = plans
    with open(os.path.join(out_dir, "profile_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n" + json.dumps({k: v for k, v in report.items() if k != "plans"}, indent=1))
    missing = [u for u in hw.unmeasured if u.startswith(("link.", "gpu, link", "gpu.block"))]
    if missing:
        print("FAILED: not measured: " + "; ".join(missing))
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", help="the profile kit directory")
    ap.add_argument("--target-out", help="write this machine's kit target (flags, cores, L3, GPU arch) here")
    ap.add_argument("--target", help="--build: a kit target written by --target-out on the machine")
    ap.add_argument("--build", action="store_true", help="build the kit here (needs the compiler venv and nvcc)")
    ap.add_argument("--hardware", default="h100-sxm-measured", help="--build: the machine's hardware.json or preset")
    ap.add_argument("--quick", action="store_true", help="--build: a small block and small buffers (smoke test)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile"))
    ap.add_argument("--gpu-backend", default="cupy", choices=["cupy", "torch", "none"],
                    help="none: the CPU part only (a smoke test where there is no GPU)")
    a = ap.parse_args(argv)
    if a.target_out:
        return target_out(a.target_out)
    if not a.dir:
        ap.error("expected the profile kit directory")
    if a.build:
        build(a.dir, a.hardware, a.quick, a.target)
        return 0
    return check(a.dir, a.out, a.gpu_backend)


if __name__ == "__main__":
    sys.exit(main())
