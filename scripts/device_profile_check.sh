#!/usr/bin/env bash
# On the GPU machine: measure hardware.json with CuPy (and a quick pass through torch.cuda), run the
# GPU profile test, and plan Qwen3 configs against the measured profile. Needs only numpy and CuPy
# (or torch); no TVM, no click. Results go to $OUT (default /tmp/helmc-profile).
#   bash scripts/device_profile_check.sh            # PY defaults to /opt/torch/.venv/bin/python
set -uo pipefail
PY=${PY:-/opt/torch/.venv/bin/python}
OUT=${OUT:-/tmp/helmc-profile}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

start=$(date +%s.%N)
"$PY" -m helmc.hardware.measure -o "$OUT/hardware.json" > "$OUT/profile-cupy.json"
echo "profile (full; cupy, else torch.cuda): $(echo "$(date +%s.%N) - $start" | bc) s -> $OUT/hardware.json"
HELMC_GPU_BACKEND=torch "$PY" -m helmc.hardware.measure --quick -o "$OUT/hardware-torch-quick.json" \
    > "$OUT/profile-torch-quick.json" && echo "profile (torch, quick) -> $OUT/hardware-torch-quick.json"
"$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/hardware/test_profile_hardware.py 2>&1 | tail -5 \
    || echo "(pytest not available here)"

"$PY" - "$OUT/hardware.json" <<'PYEOF'
import sys
sys.path.insert(0, "tests")
from helmc.hardware.profile import HardwareProfile
from helmc.planner.search_partition import plan
from helmc.runtime.bundle.plan import format_plan_table
from qwen3_configs import qwen3_spec

hw = HardwareProfile.load(sys.argv[1])
print(hw.to_json())
for model, budget in (("Qwen3-8B", None), ("Qwen3-8B", 7.0), ("Qwen3-32B", None)):
    spec = qwen3_spec(model)
    try:
        p = plan(spec, hw, gpu_budget_gib=budget)
    except Exception as e:
        print(f"\n== {model}, GPU budget {budget or 'none'} GiB: {type(e).__name__}: {e}")
        continue
    print(f"\n== {model}, GPU budget {budget or 'none'} GiB: {p.describe()}, T_plan {p.t_plan_ms:.1f} ms")
    print(format_plan_table(p, spec))
PYEOF
