#!/usr/bin/env bash
# Session 16, call B: (1) the CPU decode GEMVs with one-instruction prefetches (kit4) against session 15's (kit3) in
# `helmc profile`, one after the other on one host, and kit4 on 8 of the 16 cores; (2) Qwen3-8B fp16 under 7 GiB,
# plain split and hybrid (bundles planned from call A's profile), beside llama-bench -ngl 16, each row's T_plan under
# this run's kit4 profile and the split's CPU stage read against that profile's M (issues 15, 17).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
wait; sync; sleep 3
tail -1 "$OUT/llamacpp_build.log"
for kit in 3 4; do
  echo "== profile kit$kit $(date +%T)"
  "$PY" -m helmc.cli.main profile --kit .devrt/profile_kit$kit -o "$OUT/profile_kit$kit.json" > "$OUT/profile_kit$kit.log" 2>&1; echo "rc=$?"
  grep -E "DRAM|GEMV reads|DRAM \+ PCIe at once|per-block" "$OUT/profile_kit$kit.log" | grep -v Warning
done
echo "== profile kit4, 8 threads $(date +%T)"
TVM_NUM_THREADS=8 "$PY" -m helmc.cli.main profile --kit .devrt/profile_kit4 --no-overheads -o "$OUT/profile_kit4_t8.json" > "$OUT/profile_kit4_t8.log" 2>&1; echo "rc=$?"
grep -E "DRAM|GEMV reads" "$OUT/profile_kit4_t8.log" | grep -v Warning
echo "== fp16 7 GiB split and hybrid $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/s16_fp16_7g_split --bundle .devrt/s16_fp16_7g_hyb \
  --prompt-len 128 --new-tokens 64 --requests 3 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench \
  --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 16 --threads 16 --profile "$OUT/profile_kit4.json" \
  --out "$OUT/fp16_7g.json" > "$OUT/fp16_7g.log" 2>&1; echo "rc=$?"
grep -E "request|llama.cpp -ngl|ratio|T_plan|CPU stage|hybrid decode|^\|" "$OUT/fp16_7g.log" | grep -v Warning | tail -16
echo "== done $(date +%T)"
