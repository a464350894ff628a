#!/usr/bin/env bash
# Session 14, call C: flash_prefill through the runtime. GPU tests (batched/streamed prefill bit-identical to
# single runs; the GPU prefill paths against HF), then a 32K prompt of Qwen3-8B fp16 under 7 GiB beside
# llama-bench -p 32768 -ngl 10 (prefill_32k_ratio_vs_llamacpp; session 13: 74.65 s vs 111.8 s, 1.497).
# Built here first: tests/device/device_flash_prefill_check.py .devrt/flash_check --build,
# tests/device/build_batch_session_bundles.py .devrt/batch_session (fp16_hybrid, fp16_streamed carried),
# tests/device/device_prefill_check.py .devrt/prefill_check --build, and
# helmc build /tmp/q8cfg .devrt/b8_fp16_7g_32k/hardware.json --gpu-budget 7 --prompt-len 32768 --output-len 16 -o .devrt/b32k
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 &
"$PY" tests/device/device_flash_prefill_check.py .devrt/flash_check --out "$OUT/flash.json" 2>&1 | grep -v Warning | grep -E "error|fresh|32K|passed|FAIL"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k "hybrid or streamed" > "$OUT/gpu_tests.log" 2>&1; echo "batch tests rc=$?"
tail -3 "$OUT/gpu_tests.log"
"$PY" tests/device/device_prefill_check.py .devrt/prefill_check --out "$OUT/prefill_check.json" > "$OUT/prefill_check.log" 2>&1; echo "prefill check rc=$?"
grep -v Warning "$OUT/prefill_check.log" | tail -8
wait
tail -1 "$OUT/llamacpp_build.log"; ls -la "$M"
echo "== 32K prefill $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b32k --prompt-len 32768 --new-tokens 8 \
  --requests 1 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" \
  --llama-ngl 10 --llama-reps 1 --threads 16 --out "$OUT/prefill_32k.json" > "$OUT/prefill_32k.log" 2>&1; echo "rc=$?"
grep -E "TTFT|llama.cpp -ngl|ratio" "$OUT/prefill_32k.log" | grep -v Warning | tail -8
echo "== done $(date +%T)"
