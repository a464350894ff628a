#!/usr/bin/env bash
# Session 10, call K (not committed): Q4_K all-GPU with one int8 GEMV launch per shared x (q/k/v, gate/up), beside llama.cpp.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
"$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
echo "== step $(date +%T)"
"$PY" scripts/profile_decode_step.py .devrt/b8_q4k_gpu --weights "$M/q8b_q4k.gguf" --steps 64 --out "$OUT/step_q4k.json" 2>&1 | grep -v Warning | tail -3
wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== bench q4k $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --requests 2 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json" 2>&1 | grep -v "Warning" | tail -7
echo "== done $(date +%T)"
