#!/usr/bin/env bash
# Session 23, device call E: the hybrid op orders with every small crossing of a step pinned and asynchronous
# (ab_prefetch.py --pinned-logits --pinned-puts), Q4_K 3 GiB then fp16 7 GiB, planned from call A's profile; writes
# straight to $OUT (the device budget's last minutes: what finished comes back even if it is cut off).
set -u
source scripts/device_setup.sh
M=$HELMC_MODELS; B=.devrt/s22; D=artifacts/bench/device-2026-11-28-s23
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
for case in "q4k_3g $M/q8b_q4k.gguf" "fp16_7g $M/q8fp16"; do
  set -- $case
  echo "== $1 $(date +%T)"
  "$PY" $D/ab_prefetch.py $D/callA/profile.json $B/$1 "$2" --rounds 3 --pinned-logits --pinned-puts \
    --orders old,old_pinned,prefetch_pinned,new_pinned > "$OUT/ab_$1.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/ab_$1.log" | tail -6
done
echo "== done $(date +%T)"
