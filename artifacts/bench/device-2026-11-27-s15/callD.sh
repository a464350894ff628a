#!/usr/bin/env bash
# Session 15, call D (short, no llama.cpp): the fp16 decode GEMVs' tunings at m = 1 (device_gemv_gpu_check --sweep:
# rows per warp and unroll of the one-launch q/k/v, gate/up + SwiGLU, down + residual; warps fixed, so the bits are
# the default's), and where a 128-token fp16 prompt's time goes now that the prefill GEMMs call cuBLAS directly.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
S=artifacts/bench/device-2026-11-27-s15
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 &
"$PY" tests/device/device_gemv_gpu_check.py .devrt/gemv_sweep --out "$OUT/gemv_sweep.json" > "$OUT/gemv_sweep.log" 2>&1; echo "sweep rc=$?"
grep "one launch" "$OUT/gemv_sweep.log"; grep -v Warning "$OUT/gemv_sweep.log" | grep -A12 "^type" | head -14
wait
echo "== prefill probe $(date +%T)"
"$PY" $S/prefill_probe.py .devrt/b8_fp16_gpu "$M/q8fp16" > "$OUT/prefill_probe.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/prefill_probe.log" | head -40
echo "== done $(date +%T)"
