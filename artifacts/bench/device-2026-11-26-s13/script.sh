#!/usr/bin/env bash
# Session 13 device run (one machine, started under setsid, polled): the streamed joint prefill's GPU tests;
# helmc profile with the format-2 kit (decode GEMVs at 1 and 8 rows); serve 8 concurrent fp16 Qwen3-8B under
# 7 GiB (plan cpu(27) -> cuda(11): prefill score tiles now counted once) beside llama-batched-bench -ngl 16;
# a 32K prompt under 7 GiB beside llama-bench -ngl 10 (one repetition).
# Built here first: tests/device/build_batch_session_bundles.py (fp16_streamed), tests/device/device_profile_check.py
# .devrt/profile_kit --build, helmc build /tmp/q8cfg artifacts/profiles/h100-sxm-profiled-s11.json --gpu-budget 7
# --max-batch 8 --no-hybrid -o .devrt/b8_fp16_7g_b8, and --prompt-len 32768 --output-len 16 -o .devrt/b8_fp16_7g_32k.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
echo "== start $(date +%T)"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -s -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k streamed > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
grep -E "passed|failed|skipped|max \||Error|every logit" "$OUT/gpu_tests.log" | grep -v Warning | tail -12
echo "== profile $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/profile.log" | grep -E "GEMV reads|dram_gbs|host_read_gbs|combined" | head -6
# The peer's build only after the profile: its 16 compile jobs would take the cores the profile measures.
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
echo "== models $(date +%T)"
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1; echo "mkgguf rc=$?"
wait
tail -1 "$OUT/llamacpp_build.log"; ls -la "$M"
echo "== serve $(date +%T)"
"$PY" scripts/bench_serve.py .devrt/b8_fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 16 --threads 16 \
  --out "$OUT/serve_fp16_7g_b8.json" > "$OUT/serve.log" 2>&1; echo "rc=$?"
"$PY" - "$OUT/serve_fp16_7g_b8.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k not in ("llamacpp", "tokens_first_difference", "bundle"):
        print(k, [round(x) for x in v] if isinstance(v, list) else v)
lc = d.get("llamacpp", {}).get("by_batch", {})
print("llama", {b: (r["decode_tok_s"], r["t_pp_s"], r["t_tg_s"]) for b, r in lc.items()})
PY
echo "== 32K prefill $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_7g_32k --prompt-len 32768 --new-tokens 8 \
  --requests 1 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" \
  --llama-ngl 10 --llama-reps 1 --threads 16 --out "$OUT/prefill_32k.json" > "$OUT/prefill_32k.log" 2>&1; echo "rc=$?"
grep -E "TTFT|llama.cpp -ngl" "$OUT/prefill_32k.log" | grep -v Warning | tail -6
echo "== done $(date +%T)"
