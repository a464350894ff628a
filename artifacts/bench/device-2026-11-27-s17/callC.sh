#!/usr/bin/env bash
# Session 17, call C: the fp16 split's CPU stage kernel by kernel (cpu_stage_probe.py kernels: each compiled kernel
# of pre_attn / post_attn called in the VM's order; the GEMVs alone; the profile's GEMV pass order on the real
# weights and on the profile's constant bytes), and the thread pool's spin (default against 10000) twice each.
# Carry: .devrt/site .devrt/s17
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s17/s16_fp16_7g_split; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
echo "== kernels $(date +%T)"
"$PY" $D/cpu_stage_probe.py kernels $B "$M/q8fp16" "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/kernels.log" | tail -17
for label in default1 spin10k1 default2 spin10k2; do
  echo "== $label $(date +%T)"
  case $label in spin*) export TVM_THREAD_POOL_SPIN_COUNT=10000;; *) unset TVM_THREAD_POOL_SPIN_COUNT;; esac
  "$PY" $D/cpu_stage_probe.py step $B "$M/q8fp16" "$OUT/step_$label.json" > "$OUT/step_$label.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/step_$label.log" | tail -1 | tr ' ' '\n' | grep -E "step_us|_gbs_mean|glue" | tr '\n' ' '; echo
done
echo "== done $(date +%T)"
