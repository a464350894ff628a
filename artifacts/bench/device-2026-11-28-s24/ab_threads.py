"""Session 24: one loaded session decoding with several CPU thread-pool settings in turn, so only the pool differs.
Is the per-block CPU overhead the profile fits on the H100 hosts (+0.78 ms, against +0.22 on an H200 host) the pool
of 16 workers on 16 vCPUs (the main thread, which is worker 0 and also launches the GPU's work, and the CUDA
driver's threads contend with pinned workers)? Settings: `N` = N workers bound to cores (TVM's default binding),
`Nu` = N workers, TVM_BIND_THREADS=0 (unbound). The pool is rebuilt with TVM's `runtime.config_threadpool(1, N)`.

    python ab_threads.py BUNDLE WEIGHTS [--profile P] [--settings 16,15,14,12,16u] [--rounds 3] [--tokens 64]

With --profile the bundle is replanned from it (replan_bundle), as bench_decode --replan does.
"""
import argparse
import os
import statistics
import sys

import numpy as np


def set_pool(setting: str) -> int:
    import tvm_ffi
    n = int(setting.rstrip("u"))
    os.environ["TVM_BIND_THREADS"] = "0" if setting.endswith("u") else "1"   # read when the pool binds its workers
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, n)
    used = tvm_ffi.get_global_func("runtime.NumThreads")()
    assert used == n, f"thread pool: expected {n} workers, found {used} (the pool never grows past its first size)"
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle"); ap.add_argument("weights")
    ap.add_argument("--profile"); ap.add_argument("--settings", default="16,15,14,12,16u")
    ap.add_argument("--rounds", type=int, default=3); ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    a = ap.parse_args()
    from helmc.runtime.session import Session
    plan = None
    if a.profile:
        from helmc.planner.replan_bundle import replan_bundle
        plan = replan_bundle(a.bundle, a.profile)[0]
    s = Session.load(a.bundle, weights_dir=a.weights, plan=plan)
    plan = plan or s.plan
    names = a.settings.split(",")
    prompt = np.random.default_rng(0).integers(3, s.spec.vocab_size, a.prompt_len).tolist()
    res, toks = {n: [] for n in names}, {}
    for r in range(a.rounds + 1):
        for name in names:
            set_pool(name)
            g = s.generate(prompt_ids=prompt, max_new_tokens=a.tokens, temperature=0.0, stop_at_eos=False)
            if r:                                          # round 0 warms up every setting
                res[name].append(statistics.median(g.per_token_ms))
            toks[name] = list(g.tokens)
    m = {k: statistics.median(v) for k, v in res.items()}
    print(f"{a.bundle}: {plan.describe()}, T_plan {plan.t_plan_ms:.2f} ms")
    for name in names:
        print(f"  threads {name:<4} {m[name]:7.2f} ms/token  {names[0]}/this {m[names[0]] / m[name]:.3f}  "
              f"rounds {['%.2f' % x for x in res[name]]}  same tokens {toks[name] == toks[names[0]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
