#!/usr/bin/env bash
# Session 11, call G: helmc profile with the final kernels (the s11 preset); 8 concurrent requests, fp16 Qwen3-8B
# under 7 GiB (--max-batch 8; K-tiled m-row CPU GEMVs, joint prefill) beside llama-batched-bench -ngl 16.
# bundle: helmc build /tmp/q8cfg artifacts/profiles/h100-sxm-profiled-s10.json --gpu-budget 7 --max-batch 8 -o .devrt/b8_fp16_7g_b8
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
echo "== profile $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/profile.log" | grep -E "dram_gbs|host_read_gbs|q4_k|q6_k|q8_0|q4_0|combined|block_overhead" | head -12
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
bpid=$!
[ -f "$M/q8b_f16.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
[ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1
wait $bpid; tail -1 "$OUT/llamacpp_build.log"
echo "== serve $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b8_fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_fp16_7g_b8.json" > "$OUT/serve.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/serve.log" | tail -25
echo "== done $(date +%T)"
