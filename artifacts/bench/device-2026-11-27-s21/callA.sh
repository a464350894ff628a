#!/usr/bin/env bash
# Session 21, device call A (issue 16): GPU tests of the short-context decode attention (kernels against the
# reference, offload and batched decode bit-identical, the batched model and the KV-offload session); then
# Qwen3-8B fp16 all on the GPU: the bundle with paged_decode_short and the straightened split kernel (gpu_default)
# and one built from session 20's code (gpu_old) beside llama-bench -ngl 99 and HF on the GPU, in two orders;
# the greedy step against its captured graph. Carry .devrt/site .devrt/peers .devrt/bs.tar.xz (s21g, batch_session,
# kv_session); run under setsid with RUN_OUT=/tmp/callA.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s21g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/gpu_old ] || tar xJf .devrt/bs.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
( "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests/runtime/test_paged_attention_gpu.py
  HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py
  HELMC_GPU_SESSION_BUNDLE=.devrt/kv_session/bundle "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_session_gpu.py
) > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed|bit for bit|identical" "$OUT/gpu_tests.log" | head -20
wait; sync
tail -1 "$OUT/llamacpp_build.log"
for order in "default old" "old default"; do
  set -- $order
  skip=accelerate; [ "$1" = old ] && skip=accelerate,hf_gpu
  echo "== all-GPU, $order $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $G/gpu_$1 --bundle $G/gpu_$2 --prompt-len 128 \
    --new-tokens 128 --requests 5 --skip $skip --llama-gguf "$M/q8b_f16.gguf" \
    --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --llama-reps 3 --threads 16 \
    --out "$OUT/allgpu_$1.json" > "$OUT/allgpu_$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|^\| HF|decode_ratio_vs_llamacpp_ngl99 |tokens" "$OUT/allgpu_$1.log" | grep -v Warning | head -20
done
echo "== step $(date +%T)"
"$PY" scripts/profile_decode_step.py $G/gpu_default --weights "$M/q8fp16" --steps 128 --out "$OUT/step.json" \
  > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -3
echo "== done $(date +%T)"
