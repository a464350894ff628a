#!/usr/bin/env bash
# Session 11, call C: profile + int8 GEMV variants; one-launch fp16 GEMVs (bits, time); Q4_K 8B 3 GiB (planned from
# call B's profile) with T_plan under this run's profile; fp16 and Q4_K all-GPU with the merged launches; beside llama.cpp.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
echo "== profile $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/profile.log" | grep -E "dram_gbs|host_read_gbs|q4_k|q6_k|q8_0|q4_0|stage_read|combined|block_overhead" | head -16
echo "== variants $(date +%T)"
"$PY" experiments/quant_gemv_variants.py --run-only .devrt/qvariants --rounds 5 2>&1 | grep -v Warning
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
( [ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  [ -f "$M/q8b_f16.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  [ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
gpid=$!
echo "== gemv check $(date +%T)"
"$PY" tests/device/device_gemv_gpu_check.py .devrt/gemv_gpu_check --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1; echo "rc=$?"
grep -E "DIFFER|FAIL|differ" "$OUT/gemv.log" | head -5; grep -iE "launch|merged|one-launch|swiglu|residual|qkv" "$OUT/gemv.log" | tail -14
wait $gpid; wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== bench q4k 3g $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_3g_c --profile "$OUT/profile/hardware.json" \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 12,14 --threads 16 \
  --requests 3 --new-tokens 48 --prompt-len 128 --out "$OUT/bench_q8b_3g.json" > "$OUT/bench_q8b_3g.log" 2>&1
grep -v Warning "$OUT/bench_q8b_3g.log" | grep -E "^\| helmc|^\| llama|ratio" | head -12
echo "== bench fp16 gpu $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --skip accelerate,hf_gpu --profile "$OUT/profile/hardware.json" \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 99 --threads 16 \
  --requests 3 --peer-requests 1 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_fp16.json" > "$OUT/bench_fp16.log" 2>&1
grep -v Warning "$OUT/bench_fp16.log" | grep -E "^\| helmc|^\| llama|ratio|first divergence|top" | head -10
echo "== bench q4k gpu $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu --profile "$OUT/profile/hardware.json" \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --requests 3 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json" > "$OUT/bench_q4k_gpu.log" 2>&1
grep -v Warning "$OUT/bench_q4k_gpu.log" | grep -E "^\| helmc|^\| llama|ratio" | head -8
echo "== done $(date +%T)"
