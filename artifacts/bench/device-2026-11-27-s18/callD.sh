#!/usr/bin/env bash
# Session 18, call D (the last minutes of device time): `helmc profile` (kit6) twice on a fresh host, for the CPU
# GEMV reads by weight type against the stream read of the same run. Carry: .devrt/site .devrt/s18d (profile_kit6).
set -u
source scripts/device_setup.sh
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do
  "$PY" -m helmc.cli.main profile --kit .devrt/s18d/profile_kit6 -o "$OUT/profile$i.json" > "$OUT/profile$i.log" 2>&1
  echo "profile $i rc=$?"; grep -E "DRAM|GEMV reads" "$OUT/profile$i.log" | grep -v Warning
done
echo "== done $(date +%T)"
