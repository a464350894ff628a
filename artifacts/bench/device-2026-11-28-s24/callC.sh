#!/usr/bin/env bash
# Session 24, device call C (no llama.cpp: not enough device time left for its build): the profile with the synthetic
# stage timed in 3 rounds (calibrate.SYNTHETIC_ROUNDS), then call A's helmc rows replanned from it: the fp16 7 GiB
# hybrid with its plain split and all-GPU variants (the split's peak VRAM now without what the hybrid row left
# pooled), 8B Q4_K 3 GiB, 14B Q4_K 6 GiB. Carry as call A; RUN_OUT=/tmp/callC under setsid.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s22
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q14b_q4k.gguf" --config 14b --type q4_k >> "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|at once|per-block|rounds" "$OUT/profile.log" | grep -v Warning | tail -8
for case in "fp16_7g $M/q8fp16 split,all_gpu" "q4k_3g $M/q8b_q4k.gguf -" "q14b_6g $M/q14b_q4k.gguf -"; do
  set -- $case; extra=""; [ "$3" != "-" ] && extra="--variants $3"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle $B/$1 --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "rc=$?"; grep -E "^\| helmc|peak VRAM|T_plan \(|CPU stage:|same greedy|share" "$OUT/$1.log" | grep -v Warning | tail -12
done
echo "== done $(date +%T)"
