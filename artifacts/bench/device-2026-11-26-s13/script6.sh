#!/usr/bin/env bash
# Session 13, call 6: where the batched hybrid step's time goes (bench_serve's step_split with hybrid_wait_ms and
# resident_ms), the call-4 bundle (.devrt/b8h: cpu(29) -> cuda(9), 7 pairs of 2 streamed), no peer this time.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== models $(date +%T)"
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "rc=$?"
echo "== serve hybrid $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b8h --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --out "$OUT/serve_hybrid_b8.json" > "$OUT/serve_hybrid.log" 2>&1; echo "rc=$?"
"$PY" -c "import json,sys; d=json.load(open('$OUT/serve_hybrid_b8.json')); [print(k, d[k]) for k in ('decode_steps_tok_s_at_8','decode_tok_s_at_1','tokens_equal_single','step_split_at_1','step_split_at_8')]"
echo "== done $(date +%T)"
