#!/usr/bin/env bash
# Session 10, call F (a fresh machine: llama.cpp and the 8B models absent, so only the hybrid part ran):
# carry .devrt/site .devrt/hybrid (tests/device/build_hybrid_bundles.py .devrt/hybrid)
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
HELMC_GPU_HYBRID_BUNDLES=.devrt/hybrid "$PY" -m pytest -q -s -m gpu tests/hybrid/test_hybrid_gpu.py > "$OUT/hybrid_tests.log" 2>&1
"$PY" tests/device/device_hybrid_check.py .devrt/hybrid/hybrid2 --out "$OUT/hybrid2.json"
