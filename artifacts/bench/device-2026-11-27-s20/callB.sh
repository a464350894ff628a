#!/usr/bin/env bash
# Session 20, device call B (diagnostic): the batched GPU step table shared by every GPU stage, and bench_serve's
# split of a batch-8 step into its host parts (model call, streamed groups' enqueue, step tables). Carry
# .devrt/site .devrt/s20.tar.xz; run under setsid with RUN_OUT=/tmp/callB; poll for "== done".
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s20
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/hybrid ] || tar xJf .devrt/s20.tar.xz -C .devrt
export PATH=/usr/local/cuda/bin:$PATH
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
HELMC_GPU_BATCH_BUNDLES=$B/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests.log"
wait; sync
echo "== serve 8 $(date +%T)"
"$PY" scripts/bench_serve.py $B/fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --out "$OUT/serve_b8.json" > "$OUT/serve_b8.log" 2>&1; echo "rc=$?"
"$PY" - "$OUT/serve_b8.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("decode_steps_tok_s_at_8", "decode_tok_s_at_1", "tokens_equal_single"):
    print(k, d.get(k))
for k in ("step_split_at_1", "step_split_at_8"):
    s = dict(d.get(k) or {}); slow = s.pop("slowest", [])
    print(k, {a: round(b, 2) for a, b in s.items()})
    print("  slowest", [(x["step"], x["step_ms"], x["cpu_stage_ms"]) for x in slow])
PY
echo "== done $(date +%T)"
