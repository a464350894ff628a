"""Session 23, call B: the same hybrid session decoding with this session's op order (S_0 prefetched during the
resident part, each next copy queued before the crossing back) and with session 22's (every copy issued when its
pair starts), alternately on one loaded session, so only the order differs.

    python ab_prefetch.py PROFILE BUNDLE WEIGHTS [--rounds 4] [--tokens 64]
"""
import argparse
import statistics
import sys

import numpy as np


def old_ops(num_pairs):
    from helmc.runtime.hybrid.schedule import Op
    ops = [Op("begin")]
    for i in range(num_pairs):
        ops += [Op("copy", i), Op("cpu", i), Op("to_gpu", i), Op("wait_copy", i), Op("gpu", i), Op("release_ring", i)]
        if i + 1 < num_pairs:
            ops.append(Op("to_host", i))
    return tuple(ops + [Op("resident"), Op("finish")])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile"); ap.add_argument("bundle"); ap.add_argument("weights")
    ap.add_argument("--rounds", type=int, default=4); ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.session import Session
    plan = replan_bundle(a.bundle, a.profile)[0]
    s = Session.load(a.bundle, weights_dir=a.weights, plan=plan)
    h = s.gpu.hybrid
    new = h.schedule.ops
    old = old_ops(len(h.schedule.pairs))
    prompt = np.random.default_rng(0).integers(3, s.spec.vocab_size, 128).tolist()
    res = {"new": [], "old": []}
    toks = {}
    for r in range(a.rounds + 1):
        for name, ops in (("new", new), ("old", old)):
            object.__setattr__(h.schedule, "ops", ops)     # the experiment's only change: the order of the ops
            h.backend.forget_prefetch()
            g = s.generate(prompt_ids=prompt, max_new_tokens=a.tokens, temperature=0.0, stop_at_eos=False)
            if r:                                          # round 0 warms up both
                res[name].append(statistics.median(g.per_token_ms))
            toks[name] = list(g.tokens)
    m = {k: statistics.median(v) for k, v in res.items()}
    print(f"{a.bundle}: {plan.describe()}, T_plan {plan.t_plan_ms:.2f} ms")
    print(f"  prefetch order: {m['new']:.2f} ms/token {['%.2f' % x for x in res['new']]}")
    print(f"  session 22's:   {m['old']:.2f} ms/token {['%.2f' % x for x in res['old']]}")
    print(f"  old / new {m['old'] / m['new']:.3f}; same tokens {toks['new'] == toks['old']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
