#!/usr/bin/env python3
"""Session 25, call F: why call E's hybrid (cpu(26), 5 pairs) left the plain split's greedy tokens at token 50 of 64.

    tokens_check.py BUNDLE MODEL PROFILE OUT.json

The bench's prompt (seed 0, 128 ids) decoded greedily for 64 tokens through three plans of one bundle, made from call
E's profile: the hybrid, the plain split the bench compared it with (cpu(25)), and the plain split of the hybrid's
own host blocks (forced_split at its cpu_units, what tests/hybrid/test_hybrid_gpu.py compares with). Every decode
step's logits come back to the host, so each divergence is shown with both runs' top-2 logits: a near-tie, or not.
"""
import gc
import json
import sys
import time

import numpy as np

from helmc.hardware.profile import HardwareProfile
from helmc.model.load import load_spec
from helmc.planner.hybrid import forced_split
from helmc.planner.replan_bundle import replan_bundle
from helmc.runtime.session import Session


def decode(bundle, model, plan, prompt, n):
    t = time.time()
    s = Session.load(bundle, weights_dir=model, plan=plan)
    s.reset()
    logits = s.forward(prompt)[-1]                         # [V] of the prompt's last row
    toks, top2 = [], []
    for _ in range(n):
        order = np.argsort(logits)[-2:]                    # [2]: second, first
        toks.append(int(order[1]))
        top2.append([float(logits[order[1]]), float(logits[order[0]]), int(order[0])])
        logits = s.forward([toks[-1]])[-1]                 # [1, V] -> [V]
    print(f"{plan.describe()}: {time.time() - t:.1f} s", flush=True)
    del s
    gc.collect()
    return toks, top2


def main():
    bundle, model, profile, out = sys.argv[1:5]
    hw = HardwareProfile.load(profile)
    hybrid, spec = replan_bundle(bundle, hw)
    split, _ = replan_bundle(bundle, hw, hybrid=False)
    same = forced_split(hybrid, spec, hybrid.cpu_units)
    prompt = np.random.default_rng(0).integers(3, load_spec(model).vocab_size, 128).tolist()
    runs = {name: decode(bundle, model, p, prompt, 64) for name, p in
            (("hybrid", hybrid), ("split", split), ("same_host_split", same))}
    report = {"plans": {"hybrid": hybrid.describe(), "split": split.describe(), "same_host_split": same.describe()}}
    for name in ("split", "same_host_split"):
        a, b = runs["hybrid"][0], runs[name][0]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        row = {"first_divergence": first, "equal": a == b}
        if first < len(a):
            row["hybrid_top2"], row[f"{name}_top2"] = runs["hybrid"][1][first], runs[name][1][first]
        report[f"hybrid_vs_{name}"] = row
        print(f"hybrid vs {name}: {row}", flush=True)
    report["tokens"] = {k: v[0] for k, v in runs.items()}
    report["margins"] = {k: [t[0] - t[1] for t in v[1]] for k, v in runs.items()}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    for k, m in report["margins"].items():
        print(f"{k}: smallest top-1 - top-2 margins {sorted(m)[:3]} (at {sorted(range(64), key=lambda i: m[i])[:3]})")


if __name__ == "__main__":
    main()
