#!/usr/bin/env bash
# Session 18, call B: the streamed groups as CUDA graphs (runtime/hybrid/group_graph.py) and Q4_0 on the int8 path
# (schedules/cpu/quant/q4_0_int8.py). Carry: .devrt/site .devrt/peers .devrt/s18.tar.xz (hybrid test bundles,
# profile_kit6 built with this session's kernels, gemv8b, s16_fp16_7g_hyb, s17_q4k_3g).
#  1. pytest -m gpu tests/hybrid/test_hybrid_gpu.py: graphed groups against eager, plain splits and HF (beside the
#     llama.cpp build: no timing);
#  2. lscpu; helmc profile (kit6: the Q4_0 GEMV on the int8 path); bench_cpu_gemv at 8 threads (of 16: SMT?);
#  3. hybrid_probe.py on the fp16 7 GiB hybrid (call A, eager groups: gpu 4.70 ms + to_host 3.12 a token);
#  4. bench_decode --replan: Q4_K 3 GiB (llama -ngl 12) and fp16 7 GiB (llama -ngl 16).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s18; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
tar xJf .devrt/s18.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
echo "== gpu tests $(date +%T)"
HELMC_GPU_HYBRID_BUNDLES=$B/hybrid "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/hybrid/test_hybrid_gpu.py \
  > "$OUT/hybrid_gpu_tests.log" 2>&1; echo "hybrid gpu tests rc=$?"; grep -E "graphs:|passed|failed|Error" "$OUT/hybrid_gpu_tests.log" | tail -5
wait; sync
tail -1 "$OUT/llamacpp_build.log"
lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node0" | tee "$OUT/lscpu.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit6 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block" "$OUT/profile.log" | grep -v Warning
echo "== gemv 8 threads $(date +%T)"
"$PY" scripts/bench_cpu_gemv.py --run-only $B/gemv8b --threads 8 --rounds 2 > "$OUT/gemv_t8.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/gemv_t8.log" | grep -E "DRAM read|q4_|float16|q6_k|q8_0" | tail -22
echo "== hybrid probe $(date +%T)"
"$PY" $D/hybrid_probe.py $B/s16_fp16_7g_hyb "$M/q8fp16" "$OUT/hybrid_probe.json" --profile "$OUT/profile.json" \
  > "$OUT/hybrid_probe.log" 2>&1; echo "rc=$?"; grep -v Warning "$OUT/hybrid_probe.log" | tail -1
for case in "q4k_3g $M/q8b_q4k.gguf $B/s17_q4k_3g 12 -" "fp16_7g $M/q8fp16 $B/s16_fp16_7g_hyb 16 $M/q8b_f16.gguf"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --llama-bench /tmp/lc/build/bin/llama-bench \
    --llama-ngl $4 --llama-reps 2 --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|ratio_vs|T_plan \(|CPU stage|hybrid decode|graph" "$OUT/$1.log" | grep -v Warning | tail -9
done
echo "== done $(date +%T)"
