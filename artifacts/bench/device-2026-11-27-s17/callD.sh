#!/usr/bin/env bash
# Session 17, call D: the profile's fp16 GEMV pass and the CPU stage's GEMVs in one process on one machine
# (cpu_stage_probe.py gap: the kit's pass on a pinned and on an anonymous arena, before and after the session loads,
# then the same kernels on the session's bound weights), then the stage's decode step (step). Carry: .devrt/site .devrt/s17
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s17/s16_fp16_7g_split; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
echo "== gap $(date +%T)"
"$PY" $D/cpu_stage_probe.py gap .devrt/s17/profile_kit5 $B "$M/q8fp16" "$OUT/gap.json" > "$OUT/gap.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/gap.log" | tail -17 | head -1 | tr ' ' '\n' | grep -E "gbs|kit"
echo "== step $(date +%T)"
"$PY" $D/cpu_stage_probe.py step $B "$M/q8fp16" "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -1 | tr ' ' '\n' | grep -E "step_us|_gbs_mean|glue" | tr '\n' ' '; echo
echo "== done $(date +%T)"
