#!/usr/bin/env bash
# Session 14, call E: where a decode token goes at a 32K context under 7 GiB (call D: 234 ms a token for the plain
# split cpu(27) -> cuda(11), plan 158.7 ms): cProfile over 12 decode steps after a 32K prompt, the functions
# holding the time. Bundle as call D's (.devrt/b32k_plain).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
"$PY" - "$M/q8fp16" "$OUT" <<'PY' 2>&1 | grep -v Warning
import cProfile, pstats, sys, time
import numpy as np
from helmc.runtime.session import Session
model, out = sys.argv[1], sys.argv[2]
s = Session.load(".devrt/b32k_plain", weights_dir=model)
ids = list(np.random.default_rng(0).integers(100, 150000, 32768))
t = time.perf_counter(); s.forward(ids); print(f"prefill {time.perf_counter() - t:.2f} s", flush=True)
for _ in range(2):
    s.forward([1000])
pr = cProfile.Profile()
steps = []
pr.enable()
for _ in range(12):
    t = time.perf_counter(); s.forward([1000]); steps.append(time.perf_counter() - t)
pr.disable()
print("decode step ms", [round(x * 1e3, 1) for x in steps])
st = pstats.Stats(pr); st.sort_stats("tottime"); st.dump_stats(f"{out}/decode_32k.prof")
st.print_stats(25)
st.sort_stats("cumulative"); st.print_stats(30)
PY
