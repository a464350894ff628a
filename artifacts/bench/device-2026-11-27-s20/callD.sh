#!/usr/bin/env bash
# Session 20, device call D: helmc profile; bench_serve (warm-up at load, per-step system counters) of the
# fp16 7 GiB --max-batch 8 bundle planned again for that profile, beside llama-batched-bench at -ngl 14 (the
# most layers within 7 GiB in llama-bench's runs) and 16 (the issue's figure); then the same without the warm-up (no peer).
# Carry .devrt/site .devrt/peers .devrt/s20.tar.xz; run under setsid with RUN_OUT=/tmp/callD; poll for "== done".
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s20
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/hybrid ] || tar xJf .devrt/s20.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit7 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once" "$OUT/profile.log" | grep -v Warning
echo "== serve 8 $(date +%T)"
"$PY" scripts/bench_serve.py $B/fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 --profile "$OUT/profile.json" \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 14,16 --threads 16 \
  --out "$OUT/serve_b8.json" > "$OUT/serve_b8.log" 2>&1; echo "rc=$?"
show() { "$PY" - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("warm_up", "plan", "plan_step_ms", "decode_steps_tok_s_at_8", "decode_tok_s_at_1", "tokens_equal_single", "step_vs_plan_at_8",
          "batch_group_graphs", "serve_decode_ratio_vs_llamacpp_ngl14", "serve_decode_ratio_vs_llamacpp_ngl16"):
    print(k, d.get(k))
for k in ("step_split_at_1", "step_split_at_8"):
    s = dict(d.get(k) or {}); slow = s.pop("slowest", [])
    print(k, {a: round(b, 2) for a, b in s.items()})
    print("  slowest", [(x["step"], x["step_ms"], x["cpu_stage_ms"], x.get("system")) for x in slow])
for n, r in (d.get("llamacpp_by_ngl") or {}).items():
    print("llama -ngl", n, {b: x["decode_tok_s"] for b, x in r["by_batch"].items()})
PY
}
show "$OUT/serve_b8.json"
echo "== serve 8 without the warm-up $(date +%T)"
"$PY" scripts/bench_serve.py $B/fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 --profile "$OUT/profile.json" \
  --no-warm-up --out "$OUT/serve_b8_nowarm.json" > "$OUT/serve_b8_nowarm.log" 2>&1; echo "rc=$?"
show "$OUT/serve_b8_nowarm.json"
echo "== done $(date +%T)"
