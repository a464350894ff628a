#!/usr/bin/env bash
# Session 20, device call F (issue 16, for the next session): one all-GPU Qwen3-8B fp16 decode step: wall per step
# with the logits to the host, greedy (argmax on the GPU), and the captured graph replayed back to back; then the
# per-kernel table under Nsight Compute. Carry .devrt/site .devrt/s20e.tar.xz; RUN_OUT=/tmp/callF.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s20g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/gpu_default ] || tar xJf .devrt/s20e.tar.xz -C .devrt
export PATH=/usr/local/cuda/bin:$PATH
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; sync
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
"$PY" scripts/profile_decode_step.py $G/gpu_default --weights "$M/q8fp16" --steps 128 ${NCU:+--ncu $NCU} \
  --out "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -32
echo "== done $(date +%T)"
