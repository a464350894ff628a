"""Session 17, one-off: where a split's CPU stage spends a decode step, per block (pre_attn VM call, KV append,
attention, post_attn VM call), against the bytes each VM call reads. Usage: stage_timing.py BUNDLE MODEL_DIR OUT.json
Wraps the CPU Stage's compiled functions and KV calls with timers; everything else is the real runtime.
(Medians only: the sum of per-call medians understates the step; cpu_stage_probe.py adds means.)"""
import json
import statistics
import sys
import time

from helmc.runtime import stage as st

stages = []
_init = st.Stage.__init__


def _record(self, *a, **k):
    _init(self, *a, **k)
    stages.append(self)


st.Stage.__init__ = _record
from helmc.runtime.session import Session  # noqa: E402

bundle, model, out = sys.argv[1:4]
s = Session.load(bundle, weights_dir=model)
prompt = [(1000 + i) % s.spec.vocab_size for i in range(128)]
s.generate(prompt_ids=prompt, max_new_tokens=8, temperature=0.0, stop_at_eos=False)
cpu = [x for x in stages if x.name == "cpu"][0]
T = {"pre": [], "append": [], "attend": [], "post": []}


def timed(f, key):
    def g(*a, **kw):
        t = time.perf_counter()
        r = f(*a, **kw)
        T[key].append(time.perf_counter() - t)
        return r
    return g


for d, key in ((cpu._pre, "pre"), (cpu._post, "post")):
    for k in list(d):
        d[k] = timed(d[k], key)
for name in ("append", "attend"):
    setattr(cpu.kv, name, timed(getattr(cpu.kv, name), name))
steps = []
inner = cpu.run_blocks


def step(x, cos, sin, phase, *a, **kw):
    t = time.perf_counter()
    r = inner(x, cos, sin, phase, *a, **kw)
    if phase == "decode":
        steps.append(time.perf_counter() - t)
    return r


cpu.run_blocks = step
for k in T:
    T[k].clear()
s.generate(prompt_ids=prompt, max_new_tokens=48, temperature=0.0, stop_at_eos=False)
n = len(cpu.bindings)
spec = s.spec
H, qd, kvd, F = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
el = 2
pre_bytes = el * H * (qd + 2 * kvd)
post_bytes = el * (qd * H + 3 * H * F)
res = {"blocks": n, "step_ms_p50": 1e3 * statistics.median(steps)}
for k, v in T.items():
    res[f"{k}_us_p50"] = 1e6 * statistics.median(v)
res["pre_gbs"] = pre_bytes / (res["pre_us_p50"] * 1e3)
res["post_gbs"] = post_bytes / (res["post_us_p50"] * 1e3)
res["sum_parts_ms"] = n * sum(res[f"{k}_us_p50"] for k in T) / 1e3
res["block_bytes"] = pre_bytes + post_bytes
res["stage_read_gbs"] = n * (pre_bytes + post_bytes) / (res["step_ms_p50"] * 1e6)
json.dump(res, open(out, "w"), indent=1)
print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
