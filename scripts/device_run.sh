#!/usr/bin/env bash
# Run named helmc steps on the GPU test machine, in one go, everything landing in $OUT.
#
#   bash scripts/device_run.sh STEP [STEP ...]          (with the device tool: carry [".devrt"])
#
# Steps (arguments after '=' are comma-separated):
#   env                        GPU, driver, Python packages, TVM runtime-only import + CUDA backend
#   gpu_stage_check[=DIR]      the prebuilt stage in DIR (default .devrt/gpu_stage_check, built here by:
#                              python -m tests.device.build_gpu_stage .devrt/gpu_stage_check): its -m gpu test,
#                              then benchmarks.bench_gpu_stage_probes
#   pytest_gpu[=DIR]           pytest -m gpu tests/ (runtime-only; the stage check dir as HELMC_GPU_STAGE_DIR)
#   make_model=CONFIG[,DTYPE]  scripts/make_random_model.py into $HELMC_MODELS/CONFIG-DTYPE (qwen3-8b, float16)
#   bench=ARG,ARG,...          python -m benchmarks.bench_decode ARG ARG ... --out $OUT/bench.json
#   py=SCRIPT,ARG,...          any other script of the checkout, e.g. py=scripts/compare_hf.py,--model,...
#   mod=MODULE,ARG,...         python -m MODULE ARG ..., e.g. mod=benchmarks.bench_kv_cache,--json,$OUT/kv.json
#
# Output: $OUT/run.log (all steps), $OUT/summary.txt (one line per step: rc and seconds), and the
# JSON files the steps write (gpu_stage_check.json, bench.json). A failing step does not stop the
# others; the script's exit status is the number of failed steps (0: all passed).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=device_setup.sh
source "$here/device_setup.sh" || exit 2
cd "$HELMC_ROOT" || exit 2
log="$OUT/run.log"
summary="$OUT/summary.txt"
: >"$summary"
[ $# -gt 0 ] || { sed -n '2,20p' "$0"; exit 2; }

step_env() {
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv
  "$PY" - <<'EOF'
import importlib, platform, shutil, os
print("python", platform.python_version())
for m in ("numpy", "torch", "cupy", "transformers", "accelerate", "safetensors", "tokenizers"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "MISSING", e)
import tvm.runtime
from helmc.runtime.cuda_runtime import ensure_cuda_backend
ensure_cuda_backend()
dev = tvm.runtime.cuda(0)
print("tvm", tvm.__file__, "cuda device:", dev.device_name, dev.compute_version,
      f"{dev.total_global_memory / 2**30:.1f} GiB")
print("disk free /tmp:", f"{shutil.disk_usage('/tmp').free / 2**30:.0f} GiB",
      "host RAM:", f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
EOF
}

run_step() {
  local spec=$1 name=${1%%=*} arg="" rc t0
  [[ $spec == *=* ]] && arg=${spec#*=}
  IFS=, read -r -a args <<<"$arg"
  echo "=== step $spec ($(date -u +%H:%M:%S))"
  t0=$(date +%s.%N)
  case $name in
    env) step_env ;;
    gpu_stage_check)
      HELMC_GPU_STAGE_DIR="${args[0]:-.devrt/gpu_stage_check}" \
        "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/runtime/test_gpu_stage_prebuilt.py &&
      "$PY" -m benchmarks.bench_gpu_stage_probes "${args[0]:-.devrt/gpu_stage_check}" --out "$OUT/gpu_stage_check.json" ;;
    pytest_gpu)
      HELMC_GPU_STAGE_DIR="${args[0]:-.devrt/gpu_stage_check}" \
        "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/ ;;
    make_model)
      local cfg=${args[0]:-qwen3-8b} dt=${args[1]:-float16}
      "$PY" scripts/make_random_model.py "$HELMC_MODELS/$cfg-$dt" --config "$cfg" --dtype "$dt" --force ;;
    bench)
      "$PY" -m benchmarks.bench_decode "${args[@]}" --out "$OUT/bench.json" ;;
    py)
      "$PY" "${args[@]}" ;;
    mod)
      "$PY" -m "${args[@]}" ;;
    *) echo "unknown step '$name'"; false ;;
  esac
  rc=$?
  printf "%-40s rc=%d %6.1fs\n" "$spec" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" "BEGIN{print b-a}")" | tee -a "$summary"
  return $rc
}

failed=0
for spec in "$@"; do
  run_step "$spec" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))
done
echo "=== $failed of $# steps failed" | tee -a "$log" "$summary"
exit "$failed"
