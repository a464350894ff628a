"""Session 24, call B: does the profile's synthetic CPU stage read faster than a real split's CPU stage because its
distinct weights are too few to miss the L3? (profile_dram_vs_measured across sessions 16-24: 0.74-1.40, 8 of 12
above 1, median ~1.09; session 11 saw 2 x L3 of distinct weights read 135.6 GB/s where the GEMVs read 106.3.)
One process, interleaved rounds so host drift hits every figure alike:
  synthetic stage (the kit's cpu_bundle through measure_bundle, as `helmc profile` times it) cycling 2, 4 and 8
  distinct blocks; the real fp16 split's CPU stage (the bundle replanned with hybrid=False, one generate of
  --tokens tokens, each step's CPU stage timed as bench_decode does).

    python bias.py KIT BUNDLE WEIGHTS PROFILE [--rounds 3] [--tokens 32]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kit"); ap.add_argument("bundle"); ap.add_argument("weights"); ap.add_argument("profile")
    ap.add_argument("--rounds", type=int, default=3); ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    from helmc.hardware.kit import ProfileKit, write_synthetic_weights
    from helmc.hardware.profile import HardwareProfile
    from helmc.model.spec import ModelSpec
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.measure_bundle import measure_bundle
    from helmc.runtime.session import Session

    kit = ProfileKit.load(a.kit)
    hw = HardwareProfile.load(a.profile)
    l3 = hw.cpu.l3_bytes
    kspec = ModelSpec.from_hf_config(kit.block.hf_config(kit.synthetic_layers), "synthetic model")
    kblock = kspec.block_weight_bytes(0)
    wdir = tempfile.mkdtemp(prefix="bias-synthetic-")
    write_synthetic_weights(wdir, kit.block, kit.synthetic_layers)
    # measure_bundle cycles max(2, ceil(2 * cache / block)) distinct blocks, at most the kit's synthetic_layers
    caches = {f"synth{n}": (n * kblock) // 2 for n in (2, 4, 8)}
    plan = replan_bundle(a.bundle, a.profile, hybrid=False)[0]
    s = Session.load(a.bundle, weights_dir=a.weights, plan=plan)
    gpu = s.gpu
    steps: list[float] = []
    inner = gpu.cpu_stage_step

    def timed(x, cos, sin, phase):
        t = time.perf_counter()
        out = inner(x, cos, sin, phase)
        if phase == "decode":
            steps.append(time.perf_counter() - t)
        return out
    gpu.cpu_stage_step = timed
    split_bytes = sum(s.spec.block_weight_bytes(i) for i in plan.cpu_layers)
    prompt = np.random.default_rng(0).integers(3, s.spec.vocab_size, 128).tolist()
    s.generate(prompt_ids=prompt, max_new_tokens=8, temperature=0.0, stop_at_eos=False)   # warm-up
    res = {k: [] for k in (*caches, "split")}
    kit_cpu = os.path.join(a.kit, kit.cpu_bundle)
    for r in range(a.rounds):
        for name, cache in caches.items():
            t = measure_bundle(kit_cpu, wdir, parts=("cpu_blocks",), steps=16, warmup=3, cpu_cache_bytes=cache)
            st = t.stage("cpu")
            res[name].append((st.blocks * kblock / (st.p50_ms * 1e-3) / 1e9, st.distinct_blocks))
        steps.clear()
        s.generate(prompt_ids=prompt, max_new_tokens=a.tokens, temperature=0.0, stop_at_eos=False)
        res["split"].append((split_bytes / statistics.median(steps) / 1e9, len(plan.cpu_layers)))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.1f} GB/s" for k, v in res.items()), flush=True)
    print(f"L3 {l3 >> 20} MiB; synthetic block {kblock >> 20} MiB; the profile's stage read {hw.cpu.stage_read_gbs}; "
          f"split {plan.describe()}")
    sp = statistics.median(x for x, _ in res["split"])
    for k, v in res.items():
        g = statistics.median(x for x, _ in v)
        print(f"  {k:<7} {v[0][1]:>2} distinct blocks ({v[0][1] * kblock >> 20} MiB): {g:6.1f} GB/s  over split "
              f"{g / sp:.3f}  rounds {['%.1f' % x for x, _ in v]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
