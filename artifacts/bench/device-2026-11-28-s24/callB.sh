#!/usr/bin/env bash
# Session 24, device call B. (1) bias.py: the profile's synthetic CPU stage cycling 2, 4 and 8 distinct blocks
# against the real fp16 split's CPU stage, interleaved in one process (call A's profile_dram_vs_measured was 1.112).
# (2) session 23's untested callF: branch prefetch-staged-inputs (carried as .devrt/pf_src.tar.gz, `git archive`),
# its GPU hybrid tests, then ab_prefetch.py's old / prefetch / new orders on one session per bundle.
# Carry: .devrt/site .devrt/peers .devrt/s23.tar.xz .devrt/pf_src.tar.gz. RUN_OUT=/tmp/callB under setsid.
set -u
source scripts/device_setup.sh
OUT=${RUN_OUT:-$OUT}; mkdir -p "$OUT"
M=$HELMC_MODELS; B=$PWD/.devrt/s22; D=artifacts/bench/device-2026-11-28-s24
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d $B/fp16_7g ] || tar xJf .devrt/s23.tar.xz -C .devrt
( "$PY" .devrt/peers/mkgguf.py "$M/q8b_q4k.gguf" --config 8b --type q4_k > "$OUT/mkgguf.log" 2>&1 ) &
( "$PY" scripts/make_random_model.py "$M/q8fp16" --config qwen3-8b --dtype float16 > "$OUT/make_model.log" 2>&1 ) &
wait; sync
echo "== bias $(date +%T)"
"$PY" $D/bias.py .devrt/kit21 $B/fp16_7g "$M/q8fp16" $D/callA/profile.json --rounds 3 > "$OUT/bias.log" 2>&1
echo "rc=$?"; grep -v Warning "$OUT/bias.log" | tail -9
echo "== prefetch branch $(date +%T)"
rm -rf /tmp/pf && mkdir -p /tmp/pf && tar xzf .devrt/pf_src.tar.gz -C /tmp/pf && ln -s "$PWD/.devrt" /tmp/pf/.devrt
P=$PWD/$D/callA/profile.json
cd /tmp/pf && source scripts/device_setup.sh && OUT=${RUN_OUT:-$OUT}
HELMC_GPU_HYBRID_BUNDLES=.devrt/hybrid "$PY" -m pytest -q -m gpu tests/hybrid/test_hybrid_gpu.py -p no:cacheprovider \
  > "$OUT/gpu_tests_pf.log" 2>&1; echo "gpu tests rc=$?"; tail -1 "$OUT/gpu_tests_pf.log"
for case in "q4k_3g $M/q8b_q4k.gguf" "fp16_7g $M/q8fp16"; do
  set -- $case
  echo "== $1 $(date +%T)"
  "$PY" artifacts/bench/device-2026-11-28-s23/ab_prefetch.py $P $B/$1 "$2" --rounds 3 --orders old,prefetch,new \
    > "$OUT/ab_$1.log" 2>&1; echo "rc=$?"
  grep -v Warning "$OUT/ab_$1.log" | tail -4
done
echo "== done $(date +%T)"
