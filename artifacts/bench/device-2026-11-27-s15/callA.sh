#!/usr/bin/env bash
# Session 15, call A: the quantized GPU GEMV sweep with the int8 GEMV's k_split variants (issue 16's Q4_K lever),
# and the GPU tests of the batched/streamed hybrid after the KVCacheGPU._staged refactor (only emulated so far).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" tests/device/device_quant_gpu_check.py .devrt/quant_gpu_check --out "$OUT/quant.json" > "$OUT/quant.log" 2>&1; echo "quant rc=$?"
grep -v Warning "$OUT/quant.log" | tail -60
echo "== gpu tests $(date +%T)"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k fp16_hybrid > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
tail -3 "$OUT/gpu_tests.log"
echo "== done $(date +%T)"
