#!/usr/bin/env bash
# Session 18, call C: the quantized hybrids with this session's runtime (streamed groups as CUDA graphs) and planner
# (the DRAM + PCIe window's slowdowns as a floor), each planned from this call's profile beside llama.cpp:
# Qwen3-8B Q4_K under 3 GiB (llama -ngl 12) and Qwen3-14B Q4_K under 6 GiB (llama -ngl 22).
# Carry: .devrt/site .devrt/peers .devrt/s18c.tar.xz (q14b_q4k_6g, s17_q4k_3g, profile_kit6).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s18c
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
tar xJf .devrt/s18c.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q14b_q4k.gguf" --config 14b --type q4_k >> "$OUT/mkgguf.log" 2>&1 ) &
wait; sync
tail -1 "$OUT/llamacpp_build.log"; tail -2 "$OUT/mkgguf.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit6 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block" "$OUT/profile.log" | grep -v Warning
for case in "q4k_3g $M/q8b_q4k.gguf $B/s17_q4k_3g 12" "q14b_6g $M/q14b_q4k.gguf $B/q14b_q4k_6g 22"; do
  set -- $case
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench \
    --llama-ngl $4 --llama-reps 2 --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|ratio_vs|T_plan \(|hybrid decode|peak" "$OUT/$1.log" | grep -v Warning | tail -9
done
echo "== done $(date +%T)"
