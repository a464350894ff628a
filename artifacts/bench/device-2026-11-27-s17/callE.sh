#!/usr/bin/env bash
# Session 17, call E: the CPU stage's activations crossing as views (runtime/tvm_tensors host_view / cpu_tensor_view)
# on the Xeon (cpu_stage_probe.py step: the Python between the kernels), then `helmc profile` and the fp16 Qwen3-8B
# under 7 GiB planned from it beside llama-bench -ngl 16, and the plain split bundle as built (the CPU stage's read
# against the profile's M). Carry: .devrt/site .devrt/peers .devrt/s17
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s17; D=artifacts/bench/device-2026-11-27-s17
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
"$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; echo "model rc=$?"
echo "== step $(date +%T)"
"$PY" $D/cpu_stage_probe.py step $B/s16_fp16_7g_split "$M/q8fp16" "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/step.log" | tail -1 | tr ' ' '\n' | grep -E "step_us|_gbs_mean|append|attend|glue" | tr '\n' ' '; echo
wait; sync
tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit $B/profile_kit5 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "DRAM|GEMV reads|at once|per-block" "$OUT/profile.log" | grep -v Warning
echo "== fp16_7g $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $B/s16_fp16_7g_hyb --replan --profile "$OUT/profile.json" \
  --prompt-len 128 --new-tokens 64 --requests 3 --skip accelerate,hf_gpu --llama-gguf "$M/q8b_f16.gguf" \
  --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 16 --llama-reps 2 --threads 16 --out "$OUT/fp16_7g.json" \
  > "$OUT/fp16_7g.log" 2>&1; echo "rc=$?"
grep -E "^\| helmc|^\| llama|ratio_vs|T_plan \(|CPU stage|hybrid decode" "$OUT/fp16_7g.log" | grep -v Warning | tail -8
echo "== fp16_7g_split $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $B/s16_fp16_7g_split --profile "$OUT/profile.json" \
  --prompt-len 128 --new-tokens 64 --requests 3 --skip accelerate,hf_gpu --out "$OUT/fp16_7g_split.json" \
  > "$OUT/fp16_7g_split.log" 2>&1; echo "rc=$?"
grep -E "^\| helmc|T_plan \(|CPU stage" "$OUT/fp16_7g_split.log" | grep -v Warning | tail -4
echo "== done $(date +%T)"
