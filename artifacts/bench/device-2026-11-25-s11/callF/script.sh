#!/usr/bin/env bash
# Session 11, call F: int8 Q4_0 CPU GEMV against the fp32-lane one (and the Q4_K/Q6_K tunings) beside the stream read;
# per-kernel tables of one all-GPU decode step (ncu) with the one-launch GEMVs, fp16 and Q4_K Qwen3-8B.
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
echo "== variants $(date +%T)"
"$PY" experiments/quant_gemv_variants.py --run-only .devrt/qvariants --rounds 5 2>&1 | grep -v Warning
"$PY" experiments/quant_gemv_variants.py --run-only .devrt/qvariants --rounds 5 2>&1 | grep -v Warning
( [ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  [ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 )
echo "== step fp16 $(date +%T)"
"$PY" scripts/profile_decode_step.py .devrt/b8_fp16_gpu --weights "$M/q8fp16" --ncu /usr/local/cuda/bin/ncu --out "$OUT/step_fp16.json" > "$OUT/step_fp16.log" 2>&1
grep -v Warning "$OUT/step_fp16.log" | head -30
echo "== step q4k $(date +%T)"
"$PY" scripts/profile_decode_step.py .devrt/b8_q4k_gpu --weights "$M/q8b_q4k.gguf" --ncu /usr/local/cuda/bin/ncu --out "$OUT/step_q4k.json" > "$OUT/step_q4k.log" 2>&1
grep -v Warning "$OUT/step_q4k.log" | head -30
echo "== done $(date +%T)"
