#!/usr/bin/env bash
# Session 19, device call B (one machine, setsid, polled). Carry: .devrt/site .devrt/peers .devrt/s19b.tar.xz
# Run from a clean export of commit bfb3f69 (.devrt/s19b/src.tar.xz, untarred to /tmp/src with .devrt linked in):
# the working tree copied to the device held another change in progress.
# (hybrid test bundles, fp16_7g_hyb, fp16_7g_b8 (--max-batch 8), s17_q4k_3g, profile_kit7, the variant libraries).
# 1. GPU tests of the hybrid (the streamed prefill's block staging now in the ring) during the llama.cpp build;
# 2. the variant sweeps around the adopted settings; 3. helmc profile (kit7); 4. fp16 7 GiB hybrid (cpu(25) plans)
# beside llama -ngl 14,15,16 with helmc's peak VRAM; 5. Q4_K 3 GiB beside -ngl 12,13; 6. 8 concurrent requests on
# the fp16 7 GiB --max-batch 8 hybrid beside llama-batched-bench -ngl 16.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s19b
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/hybrid ] || tar xJf .devrt/s19b.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
HELMC_GPU_HYBRID_BUNDLES=$B/hybrid "$PY" -m pytest -q -m gpu tests/hybrid/test_hybrid_gpu.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== quant variants $(date +%T)"
OUT=$OUT "$PY" experiments/quant_gemv_variants.py --run-only $B/quant_variants --rounds 7 > "$OUT/quant_variants.log" 2>&1
echo "rc=$?"; grep -v Warning "$OUT/quant_variants.log" | grep "^v_" | tail -20
echo "== batch variants $(date +%T)"
OUT=$OUT "$PY" experiments/batch_gemv_variants.py --run-only $B/batch_variants --rounds 7 > "$OUT/batch_variants.log" 2>&1
echo "rc=$?"; grep -v Warning "$OUT/batch_variants.log" | grep "^v_" | tail -10
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit7 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block|again|implausible" "$OUT/profile.log" | grep -v Warning
for case in "fp16_7g $M/q8fp16 $B/fp16_7g_hyb 14,15,16 $M/q8b_f16.gguf" "q4k_3g $M/q8b_q4k.gguf $B/s17_q4k_3g 12,13 -"; do
  set -- $case; extra=""; [ "$5" != "-" ] && extra="--llama-gguf $5"
  echo "== $1 $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$2" --bundle "$3" --replan --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 64 --requests 3 --skip accelerate,hf_gpu $extra --llama-bench /tmp/lc/build/bin/llama-bench \
    --llama-ngl $4 --llama-reps 2 --threads 16 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|ratio_vs|T_plan \(|hybrid decode|resident:|peak" "$OUT/$1.log" | grep -v Warning | tail -14
done
echo "== serve 8 $(date +%T)"
"$PY" scripts/bench_serve.py $B/fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_b8.json" > "$OUT/serve_b8.log" 2>&1; echo "rc=$?"
"$PY" - "$OUT/serve_b8.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("decode_steps_tok_s_at_8", "decode_tok_s_at_1", "serve_decode_ratio_vs_llamacpp", "tokens_equal_single",
          "step_split_at_1", "step_split_at_8"):
    print(k, d.get(k))
print("llama", {b: r["decode_tok_s"] for b, r in d.get("llamacpp", {}).get("by_batch", {}).items()})
PY
grep "loaded" "$OUT/serve_b8.log" | head -2
echo "== done $(date +%T)"
