#!/usr/bin/env bash
# Session 11, call A: helmc profile with the int8 CPU GEMVs (Q4_K/Q6_K), then Q4_K 8B under 3 GiB and 14B under 6 GiB beside llama.cpp.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
echo "== profile $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/profile.log" | grep -iE "gemv|read|q4|q6|q8|fp16|bf16|dram" | head -30
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
echo "== mkgguf $(date +%T)"
[ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf8.log" 2>&1
[ -f "$M/q14b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q14b_q4k.gguf" --config 14b --type q4_k > "$OUT/mkgguf14.log" 2>&1
wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== bench 8b 3g $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_3g --bundle .devrt/b8_q4k_3g_plain \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 12,14 --threads 16 \
  --requests 2 --new-tokens 48 --prompt-len 128 --out "$OUT/bench_q8b_3g.json" 2>&1 | grep -v "Warning" | tail -14
echo "== bench 14b 6g $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q14b_q4k.gguf" --bundle .devrt/b14_q4k_6g --bundle .devrt/b14_q4k_6g_plain \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 20,22 --threads 16 \
  --requests 2 --new-tokens 32 --prompt-len 128 --out "$OUT/bench_q14b_6g.json" 2>&1 | grep -v "Warning" | tail -14
echo "== done $(date +%T)"
