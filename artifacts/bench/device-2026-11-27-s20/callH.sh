#!/usr/bin/env bash
# Session 20, device call H (issue 16): the greedy step against the captured graph alone after the host-path changes
# (RoPE rows from a table, PagePool's I3 in O(held)); bench_decode of the all-GPU fp16 bundle (no peer: the device
# time left does not cover llama.cpp's build). Carry .devrt/site .devrt/s20e.tar.xz; RUN_OUT=/tmp/callH.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s20g
echo "== start $(date +%T)"
[ -d $G/gpu_default ] || tar xJf .devrt/s20e.tar.xz -C .devrt
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; sync
"$PY" scripts/profile_decode_step.py $G/gpu_default --weights "$M/q8fp16" --steps 128 --cprofile "$OUT/greedy_cprofile.txt" \
  --out "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -2
head -30 "$OUT/greedy_cprofile.txt" | tail -22
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $G/gpu_default --prompt-len 128 --new-tokens 128 --requests 5 \
  --skip accelerate,hf_gpu --out "$OUT/allgpu.json" > "$OUT/allgpu.log" 2>&1; echo "rc=$?"
grep -E "^\| helmc" "$OUT/allgpu.log"
echo "== done $(date +%T)"
