# Environment for helmc on the GPU test machine; sourced by scripts/device_run.sh (or by hand:
# `source scripts/device_setup.sh`). Needs the runtime-only TVM carried in .devrt/site, built here with
#   ../shared/tools/gpu-tvm-runtime.sh .devrt/site        (or /work/shared/tools/gpu-tvm-runtime.sh)
# That machine has Python 3.12 with torch, cupy-cuda13x, transformers, accelerate, safetensors,
# tokenizers, click, rich and pytest, no TVM and no network.

HELMC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export HELMC_ROOT
if [ -x /opt/torch/.venv/bin/python ]; then PY=${PY:-/opt/torch/.venv/bin/python}; else PY=${PY:-python3}; fi
export PY
export PYTHONPATH="$HELMC_ROOT:$HELMC_ROOT/.devrt/site${PYTHONPATH:+:$PYTHONPATH}"
export TVM_USE_RUNTIME_LIB=1          # runtime-only TVM: import tvm.runtime only, no compiler library
export PYTHONUNBUFFERED=1
export OUT=${OUT:-$HELMC_ROOT/.device-out}
export HELMC_MODELS=${HELMC_MODELS:-/tmp/helmc-models}   # random-weight models are made here, not carried
# NVLink multicast stays off (KINDS.md): keep these set for anything started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" "$HELMC_MODELS"

if [ ! -f "$HELMC_ROOT/.devrt/site/tvm/lib/libtvm_runtime_cuda.so" ]; then
  echo "device_setup: expected the runtime-only TVM in $HELMC_ROOT/.devrt/site (carry .devrt), found none" >&2
  return 2 2>/dev/null || exit 2
fi

# The inputs of the hybrid-decode benchmarks, made in the background; the caller `wait`s for them:
# llama.cpp with CUDA built into /tmp/lc (.devrt/peers carried), the random GGUFs (Qwen3-8B F16 and Q4_K, Qwen3-14B
# Q4_K) and the random fp16 Qwen3-8B HF directory under $HELMC_MODELS. Logs go to $1 (default $OUT).
start_bench_inputs() {
  local logs=${1:-$OUT} m=$HELMC_MODELS
  ( bash "$HELMC_ROOT/.devrt/peers/build_llamacpp.sh" /tmp/lc > "$logs/llamacpp_build.log" 2>&1
    echo "build rc=$?" >> "$logs/llamacpp_build.log" ) &
  ( "$PY" "$HELMC_ROOT/.devrt/peers/mkgguf.py" "$m/q8b_f16.gguf" --config 8b --type f16 > "$logs/mkgguf.log" 2>&1
    "$PY" "$HELMC_ROOT/.devrt/peers/mkgguf.py" "$m/q8b_q4k.gguf" --config 8b --type q4_k >> "$logs/mkgguf.log" 2>&1
    "$PY" "$HELMC_ROOT/.devrt/peers/mkgguf.py" "$m/q14b_q4k.gguf" --config 14b --type q4_k >> "$logs/mkgguf.log" 2>&1 ) &
  ( "$PY" "$HELMC_ROOT/scripts/make_random_model.py" "$m/q8fp16" --config qwen3-8b --dtype float16 \
      > "$logs/make_model.log" 2>&1 ) &
}
