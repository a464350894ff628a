#!/usr/bin/env bash
# Session 20, device call G (issue 16): where the greedy token loop's host time goes in an all-GPU Qwen3-8B fp16
# decode (call F: 4.844 ms a greedy step against 4.491 for the captured graph replayed back to back).
# Carry .devrt/site .devrt/s20e.tar.xz; RUN_OUT=/tmp/callG.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s20g
echo "== start $(date +%T)"
[ -d $G/gpu_default ] || tar xJf .devrt/s20e.tar.xz -C .devrt
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; sync
"$PY" scripts/profile_decode_step.py $G/gpu_default --weights "$M/q8fp16" --steps 128 --cprofile "$OUT/greedy_cprofile.txt" \
  --out "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -3
head -45 "$OUT/greedy_cprofile.txt"
echo "== done $(date +%T)"
