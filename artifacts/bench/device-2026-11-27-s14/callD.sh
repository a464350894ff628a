#!/usr/bin/env bash
# Session 14, call D: decode at a 32K context under 7 GiB (call C: the hybrid plan decoded 3.69 tok/s, 263 ms a token,
# against its plan's 131 ms and llama.cpp -ngl 10's 7.19 tok/s): the hybrid bundle beside the plain split of the
# same profile, and bench_serve's step split of the hybrid one at one sequence. Built here first:
#   helmc build /tmp/q8cfg .devrt/b8_fp16_7g_32k/hardware.json --gpu-budget 7 --prompt-len 32768 --output-len 16 [--no-hybrid]
#   -o .devrt/b32k (.devrt/b32k_plain)
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
echo "== decode at 32K $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b32k_plain --bundle .devrt/b32k --prompt-len 32768 \
  --new-tokens 16 --requests 1 --skip accelerate,hf_gpu --out "$OUT/decode_32k.json" > "$OUT/decode_32k.log" 2>&1; echo "rc=$?"
grep -E "request 0|^\| helmc|^helmc" "$OUT/decode_32k.log" | grep -v Warning | tail -8
echo "== step split $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b32k --weights "$M/q8fp16" --concurrency 1 --prompt-len 32768 --new-tokens 16 \
  --out "$OUT/serve_32k.json" > "$OUT/serve_32k.log" 2>&1; echo "rc=$?"
"$PY" -c "import json; d=json.load(open('$OUT/serve_32k.json')); [print(k, d.get(k)) for k in ('decode_tok_s_at_1','step_split_at_1','tokens_equal_single')]"
echo "== done $(date +%T)"
