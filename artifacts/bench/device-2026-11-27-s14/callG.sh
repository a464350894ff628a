#!/usr/bin/env bash
# Session 14, call G (one machine, setsid, polled): issue 19's serve bar once more (the session-13 call-4 bundle
# .devrt/b8h, hybrid cpu(29) -> cuda(9), 8 concurrent beside llama-batched-bench -ngl 16), then decode at a 32K
# context under 7 GiB (hybrid .devrt/b32k) beside llama-bench -p 32768 -n 16 -ngl 10 in the same run.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
wait
tail -1 "$OUT/llamacpp_build.log"
echo "== serve hybrid $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b8h --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_hybrid_b8.json" > "$OUT/serve_hybrid.log" 2>&1; echo "rc=$?"
"$PY" - "$OUT/serve_hybrid_b8.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("decode_steps_tok_s_at_8", "decode_tok_s_at_1", "serve_decode_ratio_vs_llamacpp", "tokens_equal_single",
          "step_split_at_8"):
    print(k, d.get(k))
lc = d.get("llamacpp", {}).get("by_batch", {})
print("llama", {b: r["decode_tok_s"] for b, r in lc.items()})
PY
echo "== decode at 32K $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b32k --prompt-len 32768 \
  --new-tokens 16 --requests 1 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench \
  --llama-gguf "$M/q8b_f16.gguf" --llama-ngl 10 --llama-reps 1 --threads 16 \
  --out "$OUT/decode_32k.json" > "$OUT/decode_32k.log" 2>&1; echo "rc=$?"
grep -E "request 0|llama.cpp -ngl|ratio" "$OUT/decode_32k.log" | grep -v Warning | tail -8
echo "== done $(date +%T)"
