#!/usr/bin/env bash
# Session 23, device call A. Carry: .devrt/site .devrt/peers .devrt/s23.tar.xz (tar cJf .devrt/s23.tar.xz -C .devrt
# s22 kit21 hybrid: session 22's fp16_7g, q4k_3g, q14b_6g bundles, whose libraries this session did not change, the
# profile kit, and tests/device/build_hybrid_bundles.py's tiny hybrid bundles built from this commit).
# What it shows, all in one run on one host: the hybrid GPU tests (tokens equal the plain splits, S_0 prefetched);
# `helmc profile`; then each budget replanned from that profile beside llama-bench, the fp16 bundle also as its
# plain split (profile_dram_vs_measured, the hybrid's tokens against the split's) and all on the GPU (-ngl 99 beside).
# Run under setsid with RUN_OUT=/tmp/callA; poll for "== done" (may take two calls).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s22
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k >> "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q14b_q4k.gguf" --config 14b --type q4_k >> "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
# correctness only (the builds share the CPU meanwhile): hybrid tokens against the plain splits, on the real GPU
HELMC_GPU_HYBRID_BUNDLES=.devrt/hybrid "$PY" -m pytest -q -m gpu tests/hybrid/test_hybrid_gpu.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
wait; sync; tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|at once|per-block|gpu reserve|doubtful" "$OUT/profile.log" | grep -v Warning | tail -8
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
echo "== done $(date +%T)"
