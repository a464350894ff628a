#!/usr/bin/env bash
# Session 10, call I (not committed): batched decode on the GPU (bitwise rows), KV/session GPU tests, issue 17's profile check.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
echo "== batch decode gpu test $(date +%T)"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -s -m gpu tests/runtime/test_batch_decode_gpu.py > "$OUT/batch_gpu.log" 2>&1; echo "rc=$?"; tail -6 "$OUT/batch_gpu.log"
echo "== kv/session gpu tests $(date +%T)"
HELMC_GPU_SESSION_BUNDLE=.devrt/kv_session/bundle "$PY" -m pytest -q -m gpu tests/runtime/test_paged_attention_gpu.py tests/runtime/test_session_gpu.py 2>&1 | tail -3
echo "== profile check $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" 2>&1 | grep -v Warning | tail -40
echo "== done $(date +%T)"
