#!/usr/bin/env bash
# Session 14, call B: the tensor-core prefill attention (flash_prefill) on the GPU: errors against float64 and
# speed against attend_blocks' fp32 tiles and prefill_causal. Built here first:
#   python tests/device/device_flash_prefill_check.py .devrt/flash_check --build
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
"$PY" tests/device/device_flash_prefill_check.py .devrt/flash_check --out "$OUT/flash.json" 2>&1 | grep -v Warning
