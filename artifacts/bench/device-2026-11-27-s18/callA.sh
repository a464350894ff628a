#!/usr/bin/env bash
# Session 18, call A (drafted at the end of session 17). Carry:
# .devrt/site .devrt/peers .devrt/s17 (~40 MiB). Run under setsid with RUN_OUT=/tmp/callA; poll; tar *.log *.json.
# Measures (nothing else runs beside the probes: the llama.cpp build is waited for first):
#  1. cpu_stage_probe.py step on the fp16 split: the Python between kernels with the views and the one-sequence
#     DecodeBatch path (session 17: 180-245 us a block before them, 54 -> ~18 us on the 2-core EPYC);
#  1b. cpu_stage_probe.py kernels on the Q4_K bundles: session 16's separate q/k/v, gate/up calls against
#     session 17's one call each (schedules/cpu/quant/gemv_int8_multi.py; -3/-4% on the 2-core EPYC);
#  2. helmc profile (kit5): cpu.stage_read_gbs is new (bench_decode's profile_dram_vs_measured now uses it);
#  3. hybrid_probe.py on the fp16 7 GiB bundle planned from that profile: host ms per op kind per token (session
#     17 call E: 8 pairs predicted 84.0 ms, measured 103.3);
#  4. bench_decode --replan: fp16 7 GiB (llama -ngl 16), its split as built, Q4_K 3 GiB (llama -ngl 12).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s17; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== step $(date +%T)"
"$PY" $D/cpu_stage_probe.py step $B/s16_fp16_7g_split "$M/q8fp16" "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -1 | tr ' ' '\n' | grep -E "step_us|_gbs_mean|attend|glue" | tr '\n' ' '; echo
for b in s16_q4k_3g s17_q4k_3g; do    # Q4_K q/k/v, gate/up: separate calls (s16) against one call each (s17)
  echo "== kernels $b $(date +%T)"
  "$PY" $D/cpu_stage_probe.py kernels $B/$b "$M/q8b_q4k.gguf" "$OUT/kernels_$b.json" > "$OUT/kernels_$b.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/kernels_$b.log" | grep -E "gemv" | tail -8
done
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit5 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block" "$OUT/profile.log" | grep -v Warning
echo "== hybrid probe $(date +%T)"
"$PY" $D/hybrid_probe.py $B/s16_fp16_7g_hyb "$M/q8fp16" "$OUT/hybrid_probe.json" --profile "$OUT/profile.json" \
  > "$OUT/hybrid_probe.log" 2>&1; echo "rc=$?"; grep -v Warning "$OUT/hybrid_probe.log" | tail -1
for case in "fp16_7g $M/q8fp16 $B/s16_fp16_7g_hyb 16 $M/q8b_f16.gguf y" "fp16_7g_split $M/q8fp16 $B/s16_fp16_7g_split 16 - n" \
            "q4k_3g $M/q8b_q4k.gguf $B/s17_q4k_3g 12 - y"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"
  [ "$6" = y ] && extra="$extra --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl $4 --llama-reps 2" || extra="$extra"
  replan=--replan; [ "$1" = fp16_7g_split ] && replan=""
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" $replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|ratio_vs|T_plan \(|CPU stage|hybrid decode" "$OUT/$1.log" | grep -v Warning | tail -8
done
echo "== done $(date +%T)"
