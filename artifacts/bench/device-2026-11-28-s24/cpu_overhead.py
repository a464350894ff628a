"""Session 24, call E: the per-block CPU overhead on quantized blocks, measured. `helmc profile` fits one delta per
block on fp16 synthetic blocks (+0.31-0.34 ms on these hosts) and the planner charges it whole to every CPU block;
the Q4_K hybrids' plans came out 4-10% slow (measured / plan 0.90-0.96), the fp16 ones within 3%. Here each bundle
runs as its plain split (no copies beside the CPU stage), each step's CPU stage timed as bench_decode does, and the
overhead it implies per block, (stage - the cost model's stage with delta = 0) / blocks, is set beside the profile's
delta and beside delta x (the block's bytes / the synthetic block's).

    python cpu_overhead.py KIT PROFILE BUNDLE:WEIGHTS [BUNDLE:WEIGHTS ...] [--tokens 64] [--requests 2] [--dry]
"""
import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kit"); ap.add_argument("profile"); ap.add_argument("cases", nargs="+")
    ap.add_argument("--dry", action="store_true", help="the model's figures only, no session")
    ap.add_argument("--tokens", type=int, default=64); ap.add_argument("--requests", type=int, default=2)
    a = ap.parse_args()
    from helmc.hardware.profile import HardwareProfile
    from helmc.planner.analyze_program import analyze_program
    from helmc.planner.calibrate import decode_workload
    from helmc.planner.cost_model import DeviceRates, stage_time
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.session import Session
    hw = HardwareProfile.load(a.profile)
    from helmc.hardware.kit import ProfileKit
    from helmc.model.spec import ModelSpec
    kit = ProfileKit.load(a.kit)
    synthetic_block = ModelSpec.from_hf_config(kit.block.hf_config(kit.synthetic_layers)).block_weight_bytes(0)
    print(f"profile: cpu delta {hw.cpu.block_overhead_ms:+.3f} ms/block, stage read {hw.cpu.stage_read_gbs} GB/s")
    for case in a.cases:
        bundle, weights = case.split(":")
        plan, spec = replan_bundle(bundle, hw, hybrid=False)
        if a.dry:
            steps = [0.0]
        else:
            s = Session.load(bundle, weights_dir=weights, plan=plan)
            steps = run(s, a.tokens, a.requests)
        measured = 1e3 * statistics.median(steps)
        an, w = analyze_program(spec), decode_workload(plan)
        layers = list(plan.cpu_layers)
        load = an.stage(layers[0] + 1, layers[-1] + 2)          # units: 0 is the embedding, block i is unit i + 1
        rates = DeviceRates.of_device(hw, "cpu", analysis=an)
        zero = dataclasses.replace(rates, block_overhead_ms=0.0)
        t_with = stage_time(an, load, rates, w, blend_l3=True).total_ms
        t_zero = stage_time(an, load, zero, w, blend_l3=True).total_ms
        n = load.blocks
        nbytes = statistics.mean(spec.block_weight_bytes(i) for i in layers)
        implied = (measured - t_zero) / n
        print(f"{bundle}: {plan.describe()}: CPU stage {measured:.2f} ms for {n} blocks of {nbytes / 2**20:.1f} MiB "
              f"(M {rates.mem_gbs:.1f} GB/s); model {t_with:.2f} with delta, {t_zero:.2f} without; implied delta "
              f"{implied:+.3f} ms/block = {implied / hw.cpu.block_overhead_ms:.2f} x the profile's; bytes / synthetic "
              f"{nbytes / synthetic_block:.2f}; measured / model {measured / t_with:.3f}", flush=True)
    return 0


def run(s, tokens: int, requests: int) -> list[float]:
    """Seconds of the CPU stage in each decode step of `requests` greedy requests (after an 8-token warm-up)."""
    steps, inner = [], s.gpu.cpu_stage_step

    def timed(x, cos, sin, phase):
        t = time.perf_counter()
        out = inner(x, cos, sin, phase)
        if phase == "decode":
            steps.append(time.perf_counter() - t)
        return out
    s.gpu.cpu_stage_step = timed
    prompt = np.random.default_rng(0).integers(3, s.spec.vocab_size, 128).tolist()
    s.generate(prompt_ids=prompt, max_new_tokens=8, temperature=0.0, stop_at_eos=False)
    steps.clear()
    for _ in range(requests):
        s.generate(prompt_ids=prompt, max_new_tokens=tokens, temperature=0.0, stop_at_eos=False)
    return steps


if __name__ == "__main__":
    sys.exit(main())
