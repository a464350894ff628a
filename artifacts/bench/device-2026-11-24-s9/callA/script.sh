#!/usr/bin/env bash
# Session 9, call A (under setsid; log in $OUT/callA.log): the fused norm/RoPE kernels and token-split decode
# attention: correctness on the GPU, per-kernel step tables, all-GPU and 3 GiB Q4_K and all-GPU fp16 beside llama.cpp.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
[ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
echo "== gpu checks $(date +%T)"
"$PY" tests/device/device_gpu_stage_check.py .devrt/gpu_stage_check --out "$OUT/gpu_stage_check.json" 2>&1 | tail -12
HELMC_GPU_SESSION_BUNDLE=.devrt/kv_session/bundle "$PY" -m pytest -q -m gpu tests/runtime/test_paged_attention_gpu.py tests/runtime/test_session_gpu.py 2>&1 | tail -6
echo "== step tables $(date +%T)"
"$PY" scripts/profile_decode_step.py .devrt/b8_q4k_gpu --weights "$M/q8b_q4k.gguf" --ncu /usr/local/cuda/bin/ncu --out "$OUT/step_q4k.json" 2>&1 | grep -v Warning | tail -30
[ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1
[ -f "$M/q8b_f16.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
"$PY" scripts/profile_decode_step.py .devrt/b8_fp16_gpu --weights "$M/q8fp16" --ncu /usr/local/cuda/bin/ncu --out "$OUT/step_fp16.json" 2>&1 | grep -v Warning | tail -24
wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== bench q4k $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu --bundle .devrt/b8_q4k_3g \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99,12 --threads 16 \
  --requests 2 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json" 2>&1 | grep -v "Warning" | tail -16
echo "== bench fp16 $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --skip accelerate \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 99 --threads 16 \
  --requests 2 --peer-requests 1 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_fp16.json" 2>&1 | grep -v "Warning" | tail -14
echo "== done $(date +%T)"
