#!/usr/bin/env bash
# Session 21, device call E (issues 16, 17): `helmc profile` with a kit built from this session's code (the GPU
# stage's per-block overhead now measured on paged_decode_short and the norm-prologue GEMVs), then gpu_norm planned
# again from that profile and run (bench_decode --replan): the all-GPU plan against the measured step. Carry
# .devrt/site .devrt/kit21 .devrt/bs.tar.xz; RUN_OUT=/tmp/callE under setsid.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s21g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/gpu_norm ] || tar xJf .devrt/bs.tar.xz -C .devrt
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
"$PY" -c "import json,sys; g=json.load(open(sys.argv[1]))['gpu']; print({k: g[k] for k in ('hbm_gbs','block_overhead_ms','step_overhead_ms')}, [(r['weight_type'], r['gbs']) for r in g['gemv_reads']][:2])" "$OUT/profile.json"
wait; sync
echo "== all-GPU replanned $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $G/gpu_norm --replan --profile "$OUT/profile.json" \
  --prompt-len 128 --new-tokens 128 --requests 5 --skip accelerate,hf_gpu --out "$OUT/allgpu_replan.json" \
  > "$OUT/allgpu_replan.log" 2>&1; echo "rc=$?"
grep -E "^\| |T_plan|plan" "$OUT/allgpu_replan.log" | grep -v Warning | head -8
echo "== done $(date +%T)"
