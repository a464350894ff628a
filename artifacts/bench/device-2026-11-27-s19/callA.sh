#!/usr/bin/env bash
# Session 19, device call A. Carry:
# .devrt/site .devrt/peers .devrt/s19 (~15 MiB). Run under setsid with RUN_OUT=/tmp/callA; poll; tar *.log *.json.
# Measures (nothing timed beside the llama.cpp build: it is waited for first):
#  1. experiments/quant_gemv_variants.py --run-only: Q4_0's int8 kernel beside its fp32-lane kernel and one stream
#     read (session 18 compared them across hosts only), Q4_K / Q4_0 rows x prefetch distance x level (0.8 bar);
#  2. experiments/batch_gemv_variants.py --run-only: the fp16 8-token GEMV's tilings (issue 19's CPU 8-row rate);
#  3. helmc profile (kit6);
#  4. bench_decode --replan: 14B Q4_K 6 GiB (llama -ngl 22): RSS after the page release (session 18: RssFile 8.96
#     GiB before it); fp16 7 GiB hybrid beside llama -ngl 15 and 16 (16 used 7.41 GiB of VRAM in session 18).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s19
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q14b_q4k.gguf" --config 14b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== quant variants $(date +%T)"
OUT=$OUT "$PY" experiments/quant_gemv_variants.py --run-only $B/quant_variants --rounds 5 > "$OUT/quant_variants.log" 2>&1
echo "rc=$?"; grep -v Warning "$OUT/quant_variants.log" | tail -20
echo "== batch variants $(date +%T)"
OUT=$OUT "$PY" experiments/batch_gemv_variants.py --run-only $B/batch_variants --rounds 5 > "$OUT/batch_variants.log" 2>&1
echo "rc=$?"; grep -v Warning "$OUT/batch_variants.log" | tail -12
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit6 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block" "$OUT/profile.log" | grep -v Warning
for case in "q14b_6g $M/q14b_q4k.gguf $B/q14b_q4k_6g 22 -" "fp16_7g $M/q8fp16 $B/s16_fp16_7g_hyb 15,16 $M/q8b_f16.gguf"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --llama-bench /tmp/lc/build/bin/llama-bench \
    --llama-ngl $4 --llama-reps 2 --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|ratio_vs|T_plan \(|hybrid decode|resident:|peak" "$OUT/$1.log" | grep -v Warning | tail -10
done
echo "== done $(date +%T)"
