#!/usr/bin/env bash
# Session 22, device call B (carry as call A). Call A profiled while llama.cpp built and the models were made (its CPU
# figures are those of a loaded host) and its plans went over their budgets (7.11 of 7 GiB, 3.19 of 3): the kit's
# GPU reserve, 0.397 GiB, is below what the real runs held. Here: the models and llama.cpp first, then the profile
# alone, vram_phases.py on both bundles, and the benches from that profile with the reserve set to 0.60 GiB.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s22; D=artifacts/bench/device-2026-11-27-s22
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s22.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
wait; sync; tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|at once|per-block|gpu reserve|doubtful" "$OUT/profile.log" | grep -v Warning | tail -8
"$PY" -c "import json,sys; d=json.load(open('$OUT/profile.json')); d['gpu_reserve_bytes']=int(0.60*2**30); json.dump(d,open('$OUT/profile_r060.json','w'),indent=1)"
echo "== phases $(date +%T)"
"$PY" $D/vram_phases.py $B/fp16_7g $M/q8fp16 "$OUT/profile.json" 7 2>&1 | grep -v Warning | tail -1 | tee "$OUT/phases_fp16.json"
"$PY" $D/vram_phases.py $B/q4k_3g $M/q8b_q4k.gguf "$OUT/profile.json" 3 2>&1 | grep -v Warning | tail -1 | tee "$OUT/phases_q4k.json"
for case in "q4k_3g $M/q8b_q4k.gguf $B/q4k_3g 12,13 -" "fp16_7g $M/q8fp16 $B/fp16_7g 14,15 $M/q8b_f16.gguf"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile_r060.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --llama-bench /tmp/lc/build/bin/llama-bench \
    --llama-ngl $4 --llama-reps 2 --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|hybrid_decode_ratio|T_plan \(|hybrid decode:|peak VRAM" "$OUT/$1.log" | grep -v Warning | tail -9
done
echo "== done $(date +%T)"
