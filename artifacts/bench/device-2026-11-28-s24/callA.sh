#!/usr/bin/env bash
# Session 24, device call A: session 23's call A (every check of issue 17 in one run on one host) on the runtime main
# keeps (session 22's hybrid op order), then ab_threads.py on the Q4_K 3 GiB and fp16 7 GiB plans of the same profile.
# Carry: .devrt/site .devrt/peers .devrt/s23.tar.xz (session 22's fp16_7g, q4k_3g, q14b_6g bundles, the profile kit,
# tests/device/build_hybrid_bundles.py's tiny hybrid bundles). Run under setsid with RUN_OUT=/tmp/callA; poll for
# "== done" (two calls). THREADS_AB=0 stops after the checks (callD.sh).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s22; D=artifacts/bench/device-2026-11-28-s24
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader; nproc
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
start_bench_inputs "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
# correctness only (the builds share the CPU meanwhile): hybrid tokens against the plain splits, on the real GPU
HELMC_GPU_HYBRID_BUNDLES=.devrt/hybrid "$PY" -m pytest -q -m gpu tests/hybrid/test_hybrid_gpu.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
wait; sync; tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|at once|per-block|gpu reserve|doubtful|overheads:" "$OUT/profile.log" | grep -v Warning | tail -8
for case in "fp16_7g $M/q8fp16 $B/fp16_7g 14,15,99 $M/q8b_f16.gguf split,all_gpu" \
            "q4k_3g $M/q8b_q4k.gguf $B/q4k_3g 12,13 - -" "q14b_6g $M/q14b_q4k.gguf $B/q14b_6g 22 - -"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"; [ "$6" != "-" ] && extra="$extra --variants $6"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --llama-bench /tmp/lc/build/bin/llama-bench \
    --llama-ngl $4 --llama-reps 2 --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|hybrid_decode_ratio|within_budget =|T_plan \(|peak VRAM|CPU stage:|same greedy" \
    "$OUT/$1.log" | grep -v Warning | tail -16
done
echo "== checks done $(date +%T)"
[ "${THREADS_AB:-1}" = 1 ] && for case in "q4k_3g $M/q8b_q4k.gguf" "fp16_7g $M/q8fp16"; do
  set -- $case
  echo "== threads $1 $(date +%T)"
  "$PY" $D/ab_threads.py $B/$1 "$2" --profile "$OUT/profile.json" --settings 16,15,14,12,16u --rounds 3 \
    > "$OUT/threads_$1.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/threads_$1.log" | tail -6
done
echo "== done $(date +%T)"
