#!/usr/bin/env bash
# Session 20, device call A. Carry:
# .devrt/site .devrt/peers .devrt/s20.tar.xz (tar cJf .devrt/s20.tar.xz -C .devrt s20; s20 holds fp16_7g_b8,
# batch_session and copies of s19b's fp16_7g_hyb, s17_q4k_3g, profile_kit7, hybrid). Run under setsid with
# RUN_OUT=/tmp/callA; poll for "== done"; tar *.log *.json to $OUT; give_back.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s20
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/hybrid ] || tar xJf .devrt/s20.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k >> "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
( "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_paged_attention_gpu.py
  HELMC_GPU_BATCH_BUNDLES=$B/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py
  HELMC_GPU_HYBRID_BUNDLES=$B/hybrid "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/hybrid/test_hybrid_gpu.py
) > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests.log"
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit7 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block|again|doubtful" "$OUT/profile.log" | grep -v Warning
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
echo "== done $(date +%T)"
