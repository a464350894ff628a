#!/usr/bin/env bash
# Session 15, call B: the decode step's fewer launches on the GPU. Checks first: the int8 GEMV's SwiGLU and residual
# epilogues bit-identical to the separate kernels (device_gemv_gpu_check, fused entries), the fused decode attention
# (partials + merge in one launch) bit-identical to the two launches (pytest -m gpu test_paged_attention_gpu: offload
# vs none), a tiny Q4_K_M split through the runtime (batched == single, greedy argmax on the device). Then all-GPU
# Qwen3-8B Q4_K and fp16 beside llama-bench -ngl 99 (issue 16's 1.1x), and the Q4_K step kernel by kernel (ncu).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
"$PY" tests/device/device_gemv_gpu_check.py .devrt/gemv_fused --out "$OUT/gemv_fused.json" > "$OUT/gemv_fused.log" 2>&1; echo "gemv fused rc=$?"
grep "one launch" "$OUT/gemv_fused.log"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_paged_attention_gpu.py > "$OUT/paged_gpu.log" 2>&1; echo "paged tests rc=$?"
tail -2 "$OUT/paged_gpu.log"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k q4_k_m > "$OUT/batch_gpu.log" 2>&1; echo "batch tests rc=$?"
tail -2 "$OUT/batch_gpu.log"
wait
tail -1 "$OUT/llamacpp_build.log"; ls -la "$M"
echo "== q4_k all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --out "$OUT/q4k_gpu.json" > "$OUT/q4k_gpu.log" 2>&1; echo "rc=$?"
grep -E "tok/s|llama.cpp -ngl|ratio|p50" "$OUT/q4k_gpu.log" | grep -v Warning | tail -8
echo "== fp16 all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" \
  --llama-ngl 99 --threads 16 --out "$OUT/fp16_gpu.json" > "$OUT/fp16_gpu.log" 2>&1; echo "rc=$?"
grep -E "tok/s|llama.cpp -ngl|ratio|p50" "$OUT/fp16_gpu.log" | grep -v Warning | tail -8
echo "== q4_k step kernels $(date +%T)"
"$PY" scripts/profile_decode_step.py .devrt/b8_q4k_gpu --weights "$M/q8b_q4k.gguf" --ncu /usr/local/cuda/bin/ncu \
  --out "$OUT/step_q4k.json" > "$OUT/step_q4k.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step_q4k.log" | head -24
echo "== done $(date +%T)"
