#!/usr/bin/env bash
# Session 13, call 4 (setsid, polled): as call 3 with the serving plan counting the pages floor always and the hybrid
# ring holding the joint prefill's loan: cpu(29) -> cuda(9), 7 pairs of 2 streamed blocks, 101 ms predicted; fp16_hybrid
# now streams 2 blocks per step (its ring holds the loan), then serving 8 concurrent fp16 Qwen3-8B under 7 GiB: hybrid beside
# llama-batched-bench -ngl 16 (the plain split was measured in calls 2-3).
# Built here first (profile artifacts/profiles/h200-profiled-s13.json): helmc build /tmp/q8cfg PROFILE --gpu-budget 7
# --max-batch 8 [-o .devrt/b8h | --no-hybrid -o .devrt/b8p]; tests/device/build_batch_session_bundles.py (fp16_hybrid,
# fp16_streamed).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k "hybrid or streamed" > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
grep -E "passed|failed|skipped|max \||Error|every logit" "$OUT/gpu_tests.log" | grep -v Warning | tail -14
echo "== models $(date +%T)"
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1; echo "mkgguf rc=$?"
wait
tail -1 "$OUT/llamacpp_build.log"
show() {
"$PY" - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k not in ("llamacpp", "tokens_first_difference", "bundle", "ttft_ms_at_n", "ttft_ms_at_1"):
        print(k, v)
lc = d.get("llamacpp", {}).get("by_batch", {})
if lc: print("llama", {b: (r["decode_tok_s"], r["t_pp_s"], r["t_tg_s"]) for b, r in lc.items()})
PY
}
echo "== serve hybrid $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b8h --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_hybrid_b8.json" > "$OUT/serve_hybrid.log" 2>&1; echo "rc=$?"
show "$OUT/serve_hybrid_b8.json"
echo "== done $(date +%T)"
