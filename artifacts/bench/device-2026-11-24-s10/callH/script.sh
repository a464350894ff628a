#!/usr/bin/env bash
# Session 10, call H (not committed): fp16 GEMV with the k split (tunings, bitwise rows), fp16 and Q4_K all-GPU beside llama.cpp.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
( [ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  [ -f "$M/q8b_f16.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  [ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
gpid=$!
echo "== gemv check $(date +%T)"
"$PY" tests/device/device_gemv_gpu_check.py .devrt/gemv_gpu_check --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1; echo "rc=$?"
grep -E "DIFFER|FAIL" "$OUT/gemv.log" | head; tail -16 "$OUT/gemv.log"
wait $gpid; wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== bench fp16 $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --skip accelerate,hf_gpu \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 99 --threads 16 \
  --requests 2 --peer-requests 1 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_fp16.json" 2>&1 | grep -v "Warning" | tail -6
echo "== bench q4k $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --requests 2 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json" 2>&1 | grep -v "Warning" | tail -6
echo "== done $(date +%T)"
