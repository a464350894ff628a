#!/usr/bin/env bash
# Session 21, device call D (issue 16): Nsight Compute's per-kernel table of gpu_norm's decode step (kernels against
# the step: the gaps); Qwen3-8B Q4_K (mkgguf --type q4_k, the same file for both) all on the GPU beside llama-bench
# -ngl 99 (q4k_gpu: built here from that GGUF's header with paged_decode_short). Carry .devrt/site .devrt/peers
# .devrt/bs.tar.xz; RUN_OUT=/tmp/callD under setsid.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s21g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/q4k_gpu ] || tar xJf .devrt/bs.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1 ) &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; sync
export PATH=/usr/local/cuda/bin:$PATH
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "== ncu ($NCU) $(date +%T)"
"$PY" scripts/profile_decode_step.py $G/gpu_norm --weights "$M/q8fp16" --steps 128 ${NCU:+--ncu $NCU} \
  --out "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -16
wait; sync
tail -1 "$OUT/llamacpp_build.log"; tail -1 "$OUT/mkgguf.log"
echo "== q4k all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle $G/q4k_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --llama-reps 3 \
  --threads 16 --out "$OUT/q4k_gpu.json" > "$OUT/q4k_gpu.log" 2>&1; echo "rc=$?"
grep -E "^\| |ratio_vs_llamacpp_ngl99" "$OUT/q4k_gpu.log" | grep -v Warning | head -8
echo "== done $(date +%T)"
