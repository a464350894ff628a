#!/usr/bin/env bash
# Session 25, device call F (~4 min): tokens_check.py on session 22's fp16_7g bundle, planned from call E's profile
# (carried: callF/profile_callE.json), on the random fp16 Qwen3-8B made here as every call makes it (seed 0).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"; D=artifacts/bench/device-2026-11-28-s25
echo "== start $(date +%T)"
[ -d .devrt/s22/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
"$PY" scripts/make_random_model.py $HELMC_MODELS/q8fp16 --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1
echo "model rc=$? $(date +%T)"
"$PY" $D/tokens_check.py .devrt/s22/fp16_7g $HELMC_MODELS/q8fp16 $D/callF/profile_callE.json "$OUT/tokens_check.json" \
  2>&1 | grep -v Warning | tee "$OUT/tokens_check.log"
echo "== done $(date +%T)"
