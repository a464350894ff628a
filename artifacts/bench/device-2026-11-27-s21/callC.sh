#!/usr/bin/env bash
# Session 21, device call C (issue 16): the decode RMSNorms folded into the GEMVs (gpu_norm: fuse_norm_gemv on top
# of paged_decode_short) beside gpu_default (paged_decode_short only) and gpu_old (session 20's kernels) and
# llama-bench -ngl 99, two orders, HF on the GPU for the tokens; GPU tests of the batched model (rebuilt bundles:
# the prologue in their decode steps) and of the KV-offload session; the greedy step against its graph.
# Carry .devrt/site .devrt/peers .devrt/bs.tar.xz (s21g, batch_session, kv_session); RUN_OUT=/tmp/callC, setsid.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s21g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/gpu_norm ] || tar xJf .devrt/bs.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
( HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py
  HELMC_GPU_SESSION_BUNDLE=.devrt/kv_session/bundle "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_session_gpu.py
) > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed|bit-identical" "$OUT/gpu_tests.log" | head -12
wait; sync
tail -1 "$OUT/llamacpp_build.log"; tail -1 "$OUT/mkgguf.log"
for order in "norm default old" "old default norm"; do
  set -- $order
  skip=accelerate; [ "$1" = old ] && skip=accelerate,hf_gpu
  echo "== all-GPU, $order $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $G/gpu_$1 --bundle $G/gpu_$2 --bundle $G/gpu_$3 \
    --prompt-len 128 --new-tokens 128 --requests 5 --skip $skip --llama-gguf "$M/q8b_f16.gguf" \
    --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --llama-reps 3 --threads 16 \
    --out "$OUT/allgpu_$1.json" > "$OUT/allgpu_$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| |ratio_vs_llamacpp_ngl99" "$OUT/allgpu_$1.log" | grep -v Warning | head -20
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); [print(h['bundle'], h.get('vs_hf_gpu_tokens')) for h in d['helmc']]" "$OUT/allgpu_$1.json"
done
echo "== step $(date +%T)"
"$PY" scripts/profile_decode_step.py $G/gpu_norm --weights "$M/q8fp16" --steps 128 --out "$OUT/step.json" \
  > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -2
echo "== done $(date +%T)"
