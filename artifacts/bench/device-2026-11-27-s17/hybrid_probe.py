"""Session 17, for the next device call: where a hybrid decode token's host time goes, op by op.
  hybrid_probe.py BUNDLE MODEL OUT.json [--profile HW.json]
Wraps runtime/hybrid/cuda_backend.CudaHybridBackend's ops (copy, cpu, to_gpu, wait_copy, gpu, release_ring, to_host,
resident, finish) with host timers; with --profile the bundle is planned again from that profile (`helmc plan`).
Per op kind: calls per token and host ms per token (mean over 32 tokens after a warm-up request); the token's ms;
`to_host` is where the host waits for the GPU (the streamed group's copy and kernels), `cpu` the CPU groups."""
import json
import statistics
import sys
import time
from collections import defaultdict

from helmc.runtime.hybrid import cuda_backend as cb

OPS = ("begin", "copy", "cpu", "to_gpu", "wait_copy", "gpu", "release_ring", "to_host", "resident", "finish")
T = defaultdict(list)
for name in OPS:
    def wrap(f, name=name):
        def g(self, *a, **kw):
            t = time.perf_counter()
            r = f(self, *a, **kw)
            T[name].append(time.perf_counter() - t)
            return r
        return g
    setattr(cb.CudaHybridBackend, name, wrap(getattr(cb.CudaHybridBackend, name)))

from helmc.runtime.session import Session  # noqa: E402

bundle, model, out = sys.argv[1:4]
plan = None
if "--profile" in sys.argv:
    from helmc.planner.replan_bundle import replan_bundle
    plan, _ = replan_bundle(bundle, sys.argv[sys.argv.index("--profile") + 1])
s = Session.load(bundle, weights_dir=model, plan=plan)
prompt = [(1000 + i) % s.spec.vocab_size for i in range(128)]
s.generate(prompt_ids=prompt, max_new_tokens=16, temperature=0.0, stop_at_eos=False)
T.clear()
r = s.generate(prompt_ids=prompt, max_new_tokens=33, temperature=0.0, stop_at_eos=False)
tokens = len(T["finish"])
res = {"plan": s.plan.describe(), "tokens": tokens, "token_ms_p50": statistics.median(r.per_token_ms),
       "ops_ms_per_token": {k: 1e3 * sum(v) / tokens for k, v in T.items()},
       "calls_per_token": {k: len(v) / tokens for k, v in T.items()}}
res["host_ms_outside_ops"] = res["token_ms_p50"] - sum(res["ops_ms_per_token"].values())
json.dump(res, open(out, "w"), indent=1)
print(res["plan"], f"token {res['token_ms_p50']:.2f} ms;",
      " ".join(f"{k} {v:.2f}" for k, v in res["ops_ms_per_token"].items()), f"outside {res['host_ms_outside_ops']:.2f}")
