#!/usr/bin/env bash
# Session 10, call E: graph-node floor, GPU GEMV checks (m-row, bitwise), Q4_K all-GPU bench beside llama.cpp.
# carry: .devrt/site .devrt/peers .devrt/b8_q4k_gpu .devrt/gemv_gpu_check .devrt/profile_kit (batch_session too large
# for the same call: its test skipped; nsys is not on the machine)
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
"$PY" experiments/graph_node_overhead.py 2>&1 | tail -6
"$PY" tests/device/device_gemv_gpu_check.py .devrt/gemv_gpu_check --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -m gpu tests/runtime/test_batch_decode_gpu.py 2>&1 | tail -4
wait $gpid; wait $bpid
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --requests 2 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json"
