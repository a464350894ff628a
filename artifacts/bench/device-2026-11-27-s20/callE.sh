#!/usr/bin/env bash
# Session 20, device call E: Qwen3-8B fp16 all on the GPU, one bundle per one-row GPU GEMV tuning
# (experiments/gpu_gemv_tunings.py), beside llama-bench -ngl 99 (issue 16), in two orders; then helmc profile and
# bench_serve of the fp16 7 GiB --max-batch 8 bundle (warm-up at load) beside llama-batched-bench -ngl 14, 16 on a
# second host (issue 19). Carry .devrt/site .devrt/peers .devrt/s20e.tar.xz; run under setsid with RUN_OUT=/tmp/callE.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s20; G=.devrt/s20g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/gpu_r1u8 ] || tar xJf .devrt/s20e.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1
  "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit7 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|HBM" "$OUT/profile.log" | grep -v Warning
for order in "default r2u8 r4u4 r1u8" "r1u8 r4u4 r2u8 default"; do
  bundles=""; for v in $order; do bundles="$bundles --bundle $G/gpu_$v"; done
  tag=$(echo $order | cut -d' ' -f1)
  echo "== all-GPU, $order $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$M/q8fp16" $bundles --profile "$OUT/profile.json" --prompt-len 128 \
    --new-tokens 128 --requests 5 --skip accelerate,hf_gpu --llama-gguf "$M/q8b_f16.gguf" \
    --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --llama-reps 3 --threads 16 \
    --out "$OUT/allgpu_$tag.json" > "$OUT/allgpu_$tag.log" 2>&1; echo "rc=$?"
  grep -E "^\| helmc|^\| llama|decode_ratio_vs_llamacpp_ngl99 " "$OUT/allgpu_$tag.log" | grep -v Warning
done
echo "== serve 8 $(date +%T)"
"$PY" scripts/bench_serve.py $B/fp16_7g_b8 --weights "$M/q8fp16" --concurrency 8 --new-tokens 64 --profile "$OUT/profile.json" \
  --llama-batched-bench /tmp/lc/build/bin/llama-batched-bench --gguf "$M/q8b_f16.gguf" --ngl 14,16 --threads 16 \
  --out "$OUT/serve_b8.json" > "$OUT/serve_b8.log" 2>&1; echo "rc=$?"
"$PY" - "$OUT/serve_b8.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("warm_up", "plan", "plan_step_ms", "decode_steps_tok_s_at_8", "decode_tok_s_at_1", "tokens_equal_single",
          "step_vs_plan_at_8", "batch_group_graphs", "serve_decode_ratio_vs_llamacpp_ngl14",
          "serve_decode_ratio_vs_llamacpp_ngl16", "serve_end_to_end_ratio_vs_llamacpp"):
    print(k, d.get(k))
for k in ("step_split_at_1", "step_split_at_8"):
    s = dict(d.get(k) or {}); slow = s.pop("slowest", []); s.pop("median_system", None)
    print(k, {a: round(b, 2) for a, b in s.items()})
    print("  slowest", [(x["step"], x["step_ms"], x["cpu_stage_ms"]) for x in slow])
for n, r in (d.get("llamacpp_by_ngl") or {}).items():
    print("llama -ngl", n, {b: x["decode_tok_s"] for b, x in r["by_batch"].items()})
PY
echo "== done $(date +%T)"
