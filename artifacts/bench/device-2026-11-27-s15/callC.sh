#!/usr/bin/env bash
# Session 15, call C: call B's checks again after the fused decode attention's merge became one warp per head (no
# dependent load per split) and the int8 GEMV's x quantizing issues its passes' loads together; then all-GPU
# Qwen3-8B Q4_K and fp16 beside llama-bench -ngl 99, both steps kernel by kernel (ncu), and where a 128-token
# fp16 prompt's time goes (prefill_probe.py: cProfile after a warm-up).
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS
S=artifacts/bench/device-2026-11-27-s15
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( [ -f "$M/q8b_q4k.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1
  [ -f "$M/q8b_f16.gguf" ] || "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 >> "$OUT/mkgguf.log" 2>&1
  [ -d "$M/q8fp16" ] || "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
"$PY" tests/device/device_gemv_gpu_check.py .devrt/gemv_fused --out "$OUT/gemv_fused.json" > "$OUT/gemv_fused.log" 2>&1; echo "gemv fused rc=$?"
grep -c "bit-identical" "$OUT/gemv_fused.log"; grep -E "DIFFERS|Error" "$OUT/gemv_fused.log" | head -5
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_paged_attention_gpu.py > "$OUT/paged_gpu.log" 2>&1; echo "paged tests rc=$?"
tail -1 "$OUT/paged_gpu.log"
HELMC_GPU_BATCH_BUNDLES=.devrt/batch_session "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_batch_decode_gpu.py -k q4_k_m > "$OUT/batch_gpu.log" 2>&1; echo "batch tests rc=$?"
tail -1 "$OUT/batch_gpu.log"
wait
tail -1 "$OUT/llamacpp_build.log"
echo "== q4_k all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8b_q4k.gguf" --bundle .devrt/b8_q4k_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --threads 16 \
  --out "$OUT/q4k_gpu.json" > "$OUT/q4k_gpu.log" 2>&1; echo "rc=$?"
grep -E "request|llama.cpp -ngl|ratio" "$OUT/q4k_gpu.log" | grep -v Warning | tail -8
echo "== fp16 all-GPU $(date +%T)"
"$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle .devrt/b8_fp16_gpu --prompt-len 128 --new-tokens 128 \
  --requests 5 --skip accelerate,hf_gpu --llama-bench /tmp/lc/build/bin/llama-bench --llama-gguf "$M/q8b_f16.gguf" \
  --llama-ngl 99 --threads 16 --out "$OUT/fp16_gpu.json" > "$OUT/fp16_gpu.log" 2>&1; echo "rc=$?"
grep -E "request|llama.cpp -ngl|ratio" "$OUT/fp16_gpu.log" | grep -v Warning | tail -8
echo "== steps $(date +%T)"
for b in q4k:"$M/q8b_q4k.gguf" fp16:"$M/q8fp16"; do
  n=${b%%:*}; w=${b#*:}
  "$PY" scripts/profile_decode_step.py .devrt/b8_${n}_gpu --weights "$w" --ncu /usr/local/cuda/bin/ncu \
    --out "$OUT/step_$n.json" > "$OUT/step_$n.log" 2>&1; echo "$n rc=$?"
  grep -v Warning "$OUT/step_$n.log" | head -20
done
echo "== prefill probe $(date +%T)"
"$PY" $S/prefill_probe.py .devrt/b8_fp16_gpu "$M/q8fp16" > "$OUT/prefill_probe.log" 2>&1; echo "rc=$?"
grep -v Warning "$OUT/prefill_probe.log" | head -60
echo "== done $(date +%T)"
