#!/usr/bin/env bash
# Session 11, call D: helmc profile with the GPU synthetic stage timed through a CUDA graph; the all-GPU plans'
# T_plan under this run's profile against the measured token (fp16 and Q4_K Qwen3-8B).
set -u
source scripts/device_setup.sh
export PYTHONPATH="$HELMC_ROOT/.devrt/site:$PYTHONPATH"
M=$HELMC_MODELS
( [ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  [ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
gpid=$!
echo "== profile $(date +%T)"
"$PY" tests/device/device_profile_check.py .devrt/profile_kit --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/profile.log" | grep -E "overheads:|block_overhead|step_overhead|measured_block|roofline_block" | head -12
wait $gpid
echo "== bench fp16 gpu $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --skip accelerate,hf_gpu --profile "$OUT/profile/hardware.json" \
  --requests 3 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_fp16.json" > "$OUT/bench_fp16.log" 2>&1
grep -v Warning "$OUT/bench_fp16.log" | grep -E "T_plan \(profile\)|^\| helmc" | head -4
echo "== bench q4k gpu $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu --profile "$OUT/profile/hardware.json" \
  --requests 3 --new-tokens 64 --prompt-len 128 --out "$OUT/bench_q8b_q4k.json" > "$OUT/bench_q4k_gpu.log" 2>&1
grep -v Warning "$OUT/bench_q4k_gpu.log" | grep -E "T_plan \(profile\)|^\| helmc" | head -4
echo "== done $(date +%T)"
