#!/usr/bin/env bash
# Session 16, call A: session 15's GPU-untested runtime changes checked on the GPU (device pages written by one 2-D
# copy in the KV append, fp16 embedding rows for all-GPU sessions, the fused/in-parts decode attention split:
# device_prefill_check against HF, the paged-attention and batched tests), then `helmc profile` with a kit built
# for sm_90 (the GPU's GEMV rate per weight type, issue 17), then all-GPU Qwen3-8B Q4_K and fp16 beside
# llama-bench -ngl 99 with the rows' T_plan under that profile (issues 16, 17).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
"$PY" tests/device/device_prefill_check.py .devrt/prefill_check --out "$OUT/prefill_check.json" > "$OUT/prefill_check.log" 2>&1; echo "prefill check rc=$?"
grep -v Warning "$OUT/prefill_check.log" | tail -6
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_paged_attention_gpu.py > "$OUT/paged_gpu.log" 2>&1; echo "paged tests rc=$?"
tail -1 "$OUT/paged_gpu.log"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k q4_k_m > "$OUT/batch_gpu.log" 2>&1; echo "batch tests rc=$?"
tail -1 "$OUT/batch_gpu.log"
wait
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/profile_kit3 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/profile.log" | tail -25
echo "== q4_k all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --profile "$OUT/profile.json" --out "$OUT/q4k_gpu.json" > "$OUT/q4k_gpu.log" 2>&1; echo "rc=$?"
grep -E "request|llama.cpp -ngl|ratio|T_plan" "$OUT/q4k_gpu.log" | grep -v Warning | tail -10
echo "== fp16 all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" \
  --llama-ngl 99 --threads 16 --profile "$OUT/profile.json" --out "$OUT/fp16_gpu.json" > "$OUT/fp16_gpu.log" 2>&1; echo "rc=$?"
grep -E "request|llama.cpp -ngl|ratio|T_plan" "$OUT/fp16_gpu.log" | grep -v Warning | tail -10
echo "== done $(date +%T)"
