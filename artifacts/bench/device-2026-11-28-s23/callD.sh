#!/usr/bin/env bash
# Session 23, device call D: the hybrid op orders with the logits pinned too (ab_prefetch.py --pinned-logits) on fp16 7 GiB and Q4_K 3 GiB, planned from
# call A's profile (another host maybe: both orders run the same layout). Carry as call A.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s22; D=artifacts/bench/device-2026-11-28-s23
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
for case in "q4k_3g $M/q8b_q4k.gguf" "fp16_7g $M/q8fp16"; do
  set -- $case
  echo "== $1 $(date +%T)"
  "$PY" $D/ab_prefetch.py $D/callA/profile.json $B/$1 "$2" --rounds 3 --pinned-logits --orders old,prefetch,old_pinned,prefetch_pinned,new_pinned > "$OUT/ab_$1.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/ab_$1.log" | tail -7
done
echo "== done $(date +%T)"
