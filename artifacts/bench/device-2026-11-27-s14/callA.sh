#!/usr/bin/env bash
# Session 14, call A: the host's NUMA layout (issue 19's hypothesis for call 6's slow CPU stage) and the GPU tests
# of the batched hybrid / streamed prefill after 2f3603b (bundles: tests/device/build_batch_session_bundles.py).
set -u
source scripts/device_setup.sh
echo "== host $(date +%T)"
nproc; taskset -p $$; lscpu | grep -i -E "model name|numa|socket|core|thread|L3"
ls -d /sys/devices/system/node/node* 2>/dev/null; for n in /sys/devices/system/node/node*; do echo "$n $(cat $n/cpulist) $(grep MemTotal $n/meminfo)"; done
numactl -H 2>&1 | head -20
cat /proc/self/status | grep -i -E "cpus_allowed_list|mems_allowed_list"
nvidia-smi topo -m 2>&1 | head -8
echo "== gpu tests $(date +%T)"
"$PY" -m pytest -q -x tests/runtime/test_batch_decode_gpu.py -k "hybrid or streamed" -p no:cacheprovider 2>&1 | tail -15
echo "== done $(date +%T)"
