#!/usr/bin/env bash
# Session 12, call A: GPU tests of the streamed joint prefill (batch_session bundles fp16, fp16_streamed); serve
# 8 concurrent fp16 Qwen3-8B under 7 GiB (--max-batch 8 --no-hybrid, s11 profile) beside llama-batched-bench -ngl 16.
set -u
source scripts/device_setup.sh
M=$HELMC_MODELS
echo "== start $(date +%T)"
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
grep -E "passed|failed|skipped|max \||Error|assert" "$OUT/gpu_tests.log" | grep -v Warning | tail -12
echo "== models $(date +%T)"
[ -f "$M/q8b_f16.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
[ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1
wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== serve $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b8_fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_fp16_7g_b8.json" > "$OUT/serve.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/serve.log" | grep -E "loaded|tok_s|ratio|equal|step_ms|cpu_stage|cpu_attention" | head -30
"$PY" - "$OUT/serve_fp16_7g_b8.json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
print("ttft_ms_at_n", [round(x) for x in d["ttft_ms_at_n"]], "ttft_ms_at_1", [round(x) for x in d["ttft_ms_at_1"]])
PY
echo "== done $(date +%T)"
