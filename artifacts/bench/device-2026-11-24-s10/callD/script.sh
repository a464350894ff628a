#!/usr/bin/env bash
# Session 10, call D (under setsid): the int8-activation q4_k/q6_k GEMV (timing, tunings, error), decode attention
# lookahead + GPU tests, all-GPU Q4_K step table and bench beside llama.cpp, issue 17's profile check.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
( [ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1 ) &
gpid=$!
echo "== quant kernels $(date +%T)"
"$PY" tests/device/device_quant_gpu_check.py .devrt/quant_gpu_check --out "$OUT/quant.json" > "$OUT/quant.log" 2>&1; echo "rc=$?"
tail -16 "$OUT/quant.log"
echo "== gpu tests $(date +%T)"
HELMC_GPU_SESSION_BUNDLE=.devrt/kv_session/bundle "$PY" -m pytest -q -m gpu tests/runtime/test_paged_attention_gpu.py tests/runtime/test_session_gpu.py 2>&1 | tail -4
wait $gpid
echo "== step table q4k $(date +%T)"
"$PY" scripts/profile_decode_step.py .devrt/b8_q4k_gpu --weights "$M/q8b_q4k.gguf" --ncu /usr/local/cuda/bin/ncu --out "$OUT/step_q4k.json" 2>&1 | grep -v Warning | tail -30
wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== bench q4k $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --requests 2 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json" 2>&1 | grep -v "Warning" | tail -12
echo "== profile check $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" 2>&1 | grep -v Warning | tail -40
echo "== done $(date +%T)"
