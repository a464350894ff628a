#!/usr/bin/env bash
# Session 21, device call B (issue 16): call A's all-GPU comparison again with llama.cpp's GGUF made (call A's
# device lacked the gguf package: carried in .devrt/site now): gpu_default (paged_decode_short) and gpu_old
# (session 20's kernels) beside llama-bench -ngl 99, two orders, HF on the GPU for the tokens; first a TTFT probe:
# each bundle's time to first token for 1, 2 and 128 new tokens, and gpu_default with the short kernels switched
# off in the process (CudaOps.has_short_decode -> False). Carry .devrt/site .devrt/peers .devrt/bs.tar.xz;
# run under setsid with RUN_OUT=/tmp/callB.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; G=.devrt/s21g
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $G/gpu_old ] || tar xJf .devrt/bs.tar.xz -C .devrt
( bash .devrt/peers/build_llamacpp.sh /tmp/lc > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_f16.gguf" --config 8b --type f16 > "$OUT/mkgguf.log" 2>&1 ) &
"$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1; sync
export PATH=/usr/local/cuda/bin:$PATH
echo "== ttft probe $(date +%T)"
for cfg in "gpu_old 1" "gpu_default 1" "gpu_default 0"; do
  set -- $cfg
  "$PY" - $G/$1 "$M/q8fp16" $2 <<'PY' 2>&1 | grep -v Warning | tee -a "$OUT/ttft_probe.log"
import sys, time
import numpy as np
from helmc.runtime.kv import cuda_ops
from helmc.runtime.session import Session
bundle, model, short = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if not short:
    cuda_ops.CudaOps.has_short_decode = lambda self, d, g: False
s = Session.load(bundle, weights_dir=model, cuda_graph=True)
prompt = [int(t) for t in np.random.default_rng(0).integers(0, 150000, 128)]
s.generate(prompt_ids=prompt, max_new_tokens=128, temperature=0.0, stop_at_eos=False)
row = []
for n in (1, 2, 128, 1):
    t = [round(s.generate(prompt_ids=prompt, max_new_tokens=n, temperature=0.0, stop_at_eos=False).ttft_ms, 1)
         for _ in range(4)]
    row.append(f"new={n}: {t}")
print(f"{bundle} short={short}: TTFT ms " + "; ".join(row))
PY
done
wait; sync
tail -1 "$OUT/llamacpp_build.log"; tail -1 "$OUT/mkgguf.log"
for order in "default old" "old default"; do
  set -- $order
  skip=accelerate; [ "$1" = old ] && skip=accelerate,hf_gpu
  echo "== all-GPU, $order $(date +%T)"
  "$PY" scripts/bench_decode.py --model "$M/q8fp16" --bundle $G/gpu_$1 --bundle $G/gpu_$2 --prompt-len 128 \
    --new-tokens 128 --requests 5 --skip $skip --llama-gguf "$M/q8b_f16.gguf" \
    --llama-bench /tmp/lc/build/bin/llama-bench --llama-ngl 99 --llama-reps 3 --threads 16 \
    --out "$OUT/allgpu_$1.json" > "$OUT/allgpu_$1.log" 2>&1; echo "rc=$?"
  grep -E "^\| |ratio_vs_llamacpp|tokens" "$OUT/allgpu_$1.log" | grep -v Warning | head -20
done
echo "== done $(date +%T)"
