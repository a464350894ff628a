#!/usr/bin/env bash
# Session 24, device call E: cpu_overhead.py (the per-block CPU overhead a plain split's CPU stage implies for Q4_K
# and fp16 blocks, beside the profile's fp16-fitted delta), after `helmc profile --kit` on the same host.
# Carry .devrt/site .devrt/peers .devrt/s23.tar.xz; writes straight to $OUT.
set -u
source scripts/device_setup.sh
M=$HELMC_MODELS; B=.devrt/s22; D=artifacts/bench/device-2026-11-28-s24
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q14b_q4k.gguf" --config 14b --type q4_k >> "$OUT/mkgguf14.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|per-block" "$OUT/profile.log" | grep -v Warning | tail -3
echo "== overhead $(date +%T)"
"$PY" $D/cpu_overhead.py .devrt/kit21 "$OUT/profile.json" $B/q4k_3g:$M/q8b_q4k.gguf $B/q14b_6g:$M/q14b_q4k.gguf \
  $B/fp16_7g:$M/q8fp16 2>&1 | grep -v Warning | tee "$OUT/overhead.log"
echo "== done $(date +%T)"
