#!/usr/bin/env bash
# Session 10, call G: fp16 all-GPU beside llama.cpp; 8 concurrent requests, fp16 Qwen3-8B under 7 GiB, --max-batch 8,
# beside llama-batched-bench -ngl 16. carry .devrt/site .devrt/peers .devrt/b8_fp16_gpu .devrt/b8_fp16_7g_b8
# bundles: helmc build /tmp/q8cfg artifacts/profiles/h100-sxm-measured.json -o .devrt/b8_fp16_gpu
#          helmc build /tmp/q8cfg artifacts/profiles/h100-sxm-measured.json --gpu-budget 7 --max-batch 8 -o .devrt/b8_fp16_7g_b8
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1 ) &
bpid=$!
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1
wait $bpid
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --skip accelerate \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 99 --threads 16 \
  --requests 2 --peer-requests 1 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_fp16.json"
"$PY" scripts/bench_serve.py .devrt/b8_fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_fp16_7g_b8.json"
