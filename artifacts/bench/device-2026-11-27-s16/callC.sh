#!/usr/bin/env bash
# Session 16, call C: what a user does on a machine of their own. `helmc profile` here, the fp16 Qwen3-8B 7 GiB
# bundle planned again from it (bench_decode --replan: `helmc plan BUNDLE hardware.json`, no compiling), run beside
# llama-bench -ngl 16 on the same weights (issues 17: hybrid_decode_ratio_vs_llamacpp, T_plan against measured).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/profile_kit4 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -E "DRAM|GEMV reads|DRAM \+ PCIe at once|per-block" "$OUT/profile.log" | grep -v Warning
"$PY" -m helmc.cli.main plan .devrt/s16_fp16_7g_hyb "$OUT/profile.json" -o "$OUT/plan.json" > "$OUT/plan.log" 2>&1; echo "plan rc=$?"
grep -E "^chosen|predicted overlap" "$OUT/plan.log"
echo "== fp16 7 GiB, planned here $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/s16_fp16_7g_hyb --replan --profile "$OUT/profile.json" \
  --prompt-len 128 --new-tokens 64 --requests 2 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench \
  --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 16 --llama-reps 2 --threads 16 \
  --out "$OUT/fp16_7g_replanned.json" > "$OUT/fp16_7g_replanned.log" 2>&1; echo "rc=$?"
grep -E "request|llama.cpp -ngl|ratio|T_plan|hybrid decode|^\|" "$OUT/fp16_7g_replanned.log" | grep -v Warning | tail -12
echo "== done $(date +%T)"
