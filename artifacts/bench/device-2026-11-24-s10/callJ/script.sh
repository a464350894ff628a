#!/usr/bin/env bash
# Session 10, call J (not committed): after merging issue 18: hybrid GPU tests (rebuilt bundles), the GPU allocation
# fault tests and the session/KV GPU tests.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
echo "== hybrid gpu tests $(date +%T)"
HELMC_GPU_HYBRID_BUNDLES=.devrt/hybrid "$PY" -m pytest -q -s -m gpu tests/hybrid/test_hybrid_gpu.py > "$OUT/hybrid_tests.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|Error|hybrid[12_a-z]*:" "$OUT/hybrid_tests.log" | head -20
echo "== gpu fault + session tests $(date +%T)"
HELMC_GPU_SESSION_BUNDLE=.devrt/kv_session/bundle "$PY" -m pytest -q -s -m gpu tests/reliability/test_faults_memory.py tests/runtime/test_paged_attention_gpu.py tests/runtime/test_session_gpu.py > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|left|held|Error" "$OUT/gpu_tests.log" | tail -20
echo "== done $(date +%T)"
