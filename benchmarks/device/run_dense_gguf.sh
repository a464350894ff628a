#!/usr/bin/env bash
# The dense GGUF benchmarks on the GPU machine, side by side with llama.cpp: llama.cpp built from the carried source,
# the random-weight GGUF files made there (benchmarks.make_gguf, the seed the bundles were built from, so the same
# bytes), then benchmarks.bench_dense_gguf for each case (within its VRAM budget and on the whole GPU).
#
#   bash benchmarks/device/run_dense_gguf.sh [CASE ...]        (the device tool: carry [".devrt"]; default: all cases)
#
# Cases (name: GGUF config and mix, VRAM budget, bundle under .devrt/dense/):
#   qwen3-8b-q5km:  qwen3-8b q5_k_m, 3.5 GiB, .devrt/dense/qwen3-8b-q5km-3.5g
#   gemma3-12b-q4km: gemma3-12b q4_k_m, 6 GiB, .devrt/dense/gemma3-12b-q4km-6g
# A case whose bundle is not carried is skipped, with a line saying so.
# Carried in .devrt (made on the compiler machine; site/ and dense/ may come packed in .devrt/assets.tar.xz, unpacked
# here): site/ (the runtime-only TVM: scripts/device_setup.sh), peers/
# (build_llamacpp.sh and llama.cpp-src.tar.gz), dense/ (the bundles: no weights, a few MB each), built there by
#   python -m benchmarks.make_gguf /tmp/m/qwen3-8b-q5_k_m.gguf --config qwen3-8b --mix q5_k_m
#   helmc build /tmp/m/qwen3-8b-q5_k_m.gguf helmc/hardware/presets/h200-profiled.json --gpu-budget 3.5 \
#     -o .devrt/dense/qwen3-8b-q5km-3.5g
#   (and the same with gemma3-12b, q4_k_m, --gpu-budget 6, .devrt/dense/gemma3-12b-q4km-6g)
# It takes longer than one device command (llama.cpp's build ~3 min, each case ~5 min): start it detached and wait
# in that command, then wait and collect in the next, called at once (a machine idle for 30 s is handed back):
#   setsid nohup bash benchmarks/device/run_dense_gguf.sh > /tmp/dense.log 2>&1 < /dev/null &
#   for i in $(seq 110); do [ -f /tmp/dense_out/DONE ] && break; sleep 5; done; cat /tmp/dense.log
#   ... then: mkdir -p "$OUT"/d && cp /tmp/dense_out/*.json /tmp/dense_out/*.log "$OUT"/d/
# Output in $RESULTS (default /tmp/dense_out): CASE.json (the report, with `cases` and each
# `decode_ratio_vs_llamacpp`: copy it to benchmarks/results/ and run python -m benchmarks.make_table), CASE.log,
# make_gguf.log, llamacpp_build.log, DONE at the end. Environment: SEED (0), THREADS (16), REQUESTS (3),
# ONESHOT (2 fresh `helmc run` processes a case), CASE_TIMEOUT (1500 s).
set -u
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RESULTS=${RESULTS:-/tmp/dense_out}
tree=/tmp/dense_tree
# A copy of the tree: the device tool refreshes the checkout for each command while this runs on.
rm -rf "$tree" "$RESULTS" && mkdir -p "$tree" "$RESULTS" && cp -a "$src/." "$tree/" && cd "$tree" || exit 2
# The runtime-only TVM may travel packed, as .devrt/assets.tar.xz (site/ and the bundles in it).
[ -d .devrt/site ] || [ ! -f .devrt/assets.tar.xz ] || ( cd .devrt && tar xJf assets.tar.xz ) || exit 2
source scripts/device_setup.sh || exit 2
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
M=$HELMC_MODELS LC=/tmp/lc
declare -A CONFIG=([qwen3-8b-q5km]="qwen3-8b q5_k_m 3.5 qwen3-8b-q5km-3.5g Qwen3-8B Q5_K_M"
                   [gemma3-12b-q4km]="gemma3-12b q4_k_m 6 gemma3-12b-q4km-6g Gemma-3-12B Q4_K_M")
CASES=${*:-qwen3-8b-q5km gemma3-12b-q4km}

mkdir -p "$LC" && ( cd "$LC" && { [ -d gguf-py ] || tar xzf "$tree/.devrt/peers/llama.cpp-src.tar.gz"; } ) || exit 2
export PYTHONPATH=$PYTHONPATH:$LC/gguf-py
( [ -x $LC/build/bin/llama-bench ] || bash .devrt/peers/build_llamacpp.sh $LC > "$RESULTS/llamacpp_build.log" 2>&1
  echo "build rc=$?" >> "$RESULTS/llamacpp_build.log" ) &
LB=$!
for c in $CASES; do
  [ -n "${CONFIG[$c]:-}" ] || { el "case $c: expected one of ${!CONFIG[*]}"; continue; }
  read -r config mix _ <<< "${CONFIG[$c]}"
  f=$M/$config-$mix.gguf
  [ -f "$f" ] || $PY -m benchmarks.make_gguf "$f" --config "$config" --mix "$mix" --seed "${SEED:-0}" >> "$RESULTS/make_gguf.log" 2>&1 \
    || { el "make_gguf $c failed: $(tail -1 "$RESULTS/make_gguf.log")"; rm -f "$f"; }
done
el "GGUF files made: $(ls -la $M/*.gguf 2>/dev/null | awk '{print $5, $9}' | tr '\n' ' ')"
wait $LB; el "llama.cpp built: $(tail -1 "$RESULTS/llamacpp_build.log")"
for c in $CASES; do
  [ -n "${CONFIG[$c]:-}" ] || continue
  read -r config mix budget bundle label <<< "${CONFIG[$c]}"
  if [ ! -d ".devrt/dense/$bundle" ]; then el "case $c: skipped, no bundle .devrt/dense/$bundle carried"; continue; fi
  if [ ! -f "$M/$config-$mix.gguf" ]; then el "case $c: skipped, no GGUF file"; continue; fi
  timeout "${CASE_TIMEOUT:-1500}" $PY -m benchmarks.bench_dense_gguf --gguf "$M/$config-$mix.gguf" \
    --bundle ".devrt/dense/$bundle" --budget "$budget" --profile helmc/hardware/presets/h200-profiled.json \
    --llama-bench $LC/build/bin/llama-bench --threads "${THREADS:-16}" --requests "${REQUESTS:-3}" \
    --oneshot-runs "${ONESHOT:-2}" --seed "${SEED:-0}" --label "$label (random weights)" \
    --out "$RESULTS/$c.json" > "$RESULTS/$c.log" 2>&1
  el "case $c: rc=$?"; grep -E "decode_ratio_vs_llamacpp|within_budget:|all_gpu:" "$RESULTS/$c.log" | tail -8
done
touch "$RESULTS/DONE"
