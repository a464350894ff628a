#!/usr/bin/env bash
# Session 17, call A: session 16's GPU-untested decode append inside the fused attention launch (paged attention
# GPU tests, the prefill check's greedy tokens against HF), `helmc profile` with the GEMV rounds and the Q4_K scale
# unpack (kit5), where a split's CPU stage spends its decode step (stage_timing.py), then every bundle planned again
# from this host's profile (bench_decode --replan) beside llama-bench on the same weights.
# Carry: .devrt/site .devrt/peers .devrt/s17 (the bundles and kit). Run under setsid with RUN_OUT=/tmp/callA.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s17; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_paged_attention_gpu.py > "$OUT/paged_gpu.log" 2>&1; echo "paged tests rc=$?"; tail -1 "$OUT/paged_gpu.log"
"$PY" tests/device/device_prefill_check.py $B/prefill_check --out "$OUT/prefill_check.json" > "$OUT/prefill_check.log" 2>&1; echo "prefill check rc=$?"
grep -v Warning "$OUT/prefill_check.log" | tail -4
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit5 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block" "$OUT/profile.log" | grep -v Warning
echo "== stage timing $(date +%T)"
"$PY" -m helmc.cli.main plan $B/s16_fp16_7g_split "$OUT/profile.json" -o "$OUT/split_plan.json" > "$OUT/split_plan.log" 2>&1
"$PY" $D/stage_timing.py $B/s16_fp16_7g_split "$M/q8fp16" "$OUT/stage_timing.json" > "$OUT/stage_timing.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/stage_timing.log" | tail -1
for case in "q4k_gpu $M/q8b_q4k.gguf $B/b8_q4k_gpu 99 - y" "fp16_gpu $M/q8fp16 $B/b8_fp16_gpu 99 $M/q8b_f16.gguf y" \
            "fp16_7g $M/q8fp16 $B/s16_fp16_7g_hyb 16 $M/q8b_f16.gguf y" "fp16_7g_split $M/q8fp16 $B/s16_fp16_7g_split 16 - n" \
            "q4k_3g $M/q8b_q4k.gguf $B/s16_q4k_3g 12 - y"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"
  [ "$6" = y ] && extra="$extra --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl $4 --llama-reps 2"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "llama.cpp -ngl|ratio_vs|T_plan \(|CPU stage|hybrid decode" "$OUT/$1.log" | grep -v Warning | tail -6
done
echo "== done $(date +%T)"
