#!/usr/bin/env bash
# Session 22, device call F (carry as call D). Does the layout the window picks matter on the host? fp16 under 7 GiB
# planned from this host's profile as measured, and from the same profile with the window's CPU rate set to 0.9 of
# its rate alone (host 3's ratio; host 4's was 0.62, where the planner streamed 12 single blocks), beside llama-bench.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=.devrt/s22
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s22c.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
export PATH=/usr/local/cuda/bin:$PATH
wait; sync; tail -1 "$OUT/llamacpp_build.log"
echo "== profile $(date +%T)"
"$PY" -m helmc.cli.main profile --kit .devrt/kit21 -o "$OUT/profile.json" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
grep -E "at once|gpu reserve" "$OUT/profile.log" | grep -v Warning | tail -3
"$PY" -c "import json; d=json.load(open('$OUT/profile.json')); d['link']['cpu_read_concurrent_gbs']=round(0.9*d['cpu']['host_read_gbs'],2); json.dump(d,open('$OUT/profile_w090.json','w'),indent=1)"
"$PY" scripts/bench_decode.py --model $M/q8fp16 --bundle $B/fp16_7g --replan --profile "$OUT/profile.json" --prompt-len 128 \
  --new-tokens 64 --requests 3 --skip accelerate,hf_gpu --llama-gguf $M/q8b_f16.gguf --llama-bench /tmp/lc/build/bin/llama-bench \
  --llama-ngl 14 --llama-reps 2 --threads 16 --out "$OUT/fp16_7g.json" > "$OUT/fp16_7g.log" 2>&1; echo "rc=$?"
grep -E "^\| helmc|^\| llama|within_budget =" "$OUT/fp16_7g.log" | grep -v Warning | tail -5
"$PY" scripts/bench_decode.py --model $M/q8fp16 --bundle $B/fp16_7g --replan --profile "$OUT/profile_w090.json" --prompt-len 128 \
  --new-tokens 64 --requests 3 --skip accelerate,hf_gpu --out "$OUT/fp16_7g_w090.json" > "$OUT/fp16_7g_w090.log" 2>&1; echo "rc=$?"
grep -E "^\| helmc" "$OUT/fp16_7g_w090.log" | tail -2
echo "== done $(date +%T)"
