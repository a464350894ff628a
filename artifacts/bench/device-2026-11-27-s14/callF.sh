#!/usr/bin/env bash
# Session 14, call F: decode at a 32K context under 7 GiB after the page pool's staging mutators stopped running
# every invariant (151e28b), the plain split and the hybrid beside llama-bench -p 32768 -n 16 -ngl 10 in one run.
# Bundles as call D's (.devrt/b32k_plain, .devrt/b32k).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
wait
tail -1 "$OUT/llamacpp_build.log"
echo "== decode at 32K $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b32k_plain --bundle .devrt/b32k --prompt-len 32768 \
  --new-tokens 16 --requests 1 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench \
  --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 10 --llama-reps 1 --threads 16 \
  --out "$OUT/decode_32k.json" > "$OUT/decode_32k.log" 2>&1; echo "rc=$?"
grep -E "request 0|^\| helmc|^helmc|llama.cpp -ngl" "$OUT/decode_32k.log" | grep -v Warning | tail -14
echo "== done $(date +%T)"
