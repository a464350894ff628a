#!/usr/bin/env bash
# Session 17, call B: why the fp16 split's CPU stage reads its weights at 80 GB/s where the profile's GEMVs read 112
# (call A: 1.1-1.35 ms a block beyond bytes / M). cpu_stage_probe.py step under TVM's thread-pool settings (the
# workers' spin before they sleep, one thread per physical core), then place (the same calls back to back on the
# weights as bound, on copies in one anonymous arena, on huge pages). Carry: .devrt/site .devrt/s17
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s17/s16_fp16_7g_split; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu -e > "$OUT/lscpu.txt"; lscpu | grep -E "Model name|Thread|Core|Socket|MHz|NUMA" | tee -a "$OUT/lscpu.txt"
cat /sys/kernel/mm/transparent_hugepage/enabled; df -h /tmp | tail -1
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
PHYS=$(for c in /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list; do cut -d, -f1 "$c" | cut -d- -f1; done | sort -un | paste -sd,)
echo "one CPU per core: $PHYS"
run() {  # label, env/taskset prefix...
  local label=$1; shift
  echo "== $label $(date +%T)"
  env "$@" "$PY" $D/cpu_stage_probe.py step $B "$M/q8fp16" "$OUT/step_$label.json" > "$OUT/step_$label.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/step_$label.log" | tail -1
}
run default
run spin0 TVM_THREAD_POOL_SPIN_COUNT=0
run spin10k TVM_THREAD_POOL_SPIN_COUNT=10000
run phys taskset -c "$PHYS"
run phys_spin0 TVM_THREAD_POOL_SPIN_COUNT=0 taskset -c "$PHYS"
echo "== place $(date +%T)"
"$PY" $D/cpu_stage_probe.py place $B "$M/q8fp16" "$OUT/place.json" > "$OUT/place.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/place.log" | tail -1
echo "== done $(date +%T)"
