"""Build, on the compiler machine, the small split bundle that tests/runtime/test_session_gpu.py runs on the GPU.

    python -m tests.device.build_kv_session_bundle .devrt/kv_session [--hardware PROFILE] [--layers 4]

Writes DIR/model (a random-weight tiny Qwen3 from helmc.testing, fp16) and DIR/bundle: helmc's
normal build for the GPU test machine's profile (default helmc/hardware/presets/h100-sxm-measured.json,
sm_90: H100 and H200), weights copied in, with the plan's split forced to cpu(2) -> cuda(L): the
embedding and block 0 on the CPU, the other blocks and the head on the GPU, so one request uses
both KV caches. The search alone would put a model this small wholly on the GPU. Carry .devrt to
the GPU machine; the test finds the bundle at .devrt/kv_session/bundle or $HELMC_GPU_SESSION_BUNDLE.
Regenerate by running this again (it replaces DIR/model and DIR/bundle).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_PROFILE = os.path.join(ROOT, "helmc", "hardware", "presets", "h100-sxm-measured.json")
CPU_UNITS = 2                      # embedding + block 0 on the CPU


def build(out_dir: str, hardware: str, layers: int) -> str:
    from helmc.hardware.profile import load_hardware
    from helmc.compiler.pipeline import build as run_pipeline
    from helmc.planner.search_partition import plan as search
    from helmc.testing import make_tiny_model

    t0 = time.time()
    model_dir, bundle_dir = os.path.join(out_dir, "model"), os.path.join(out_dir, "bundle")
    for d in (model_dir, bundle_dir):
        if os.path.isdir(d):
            shutil.rmtree(d)
    make_tiny_model(model_dir, "qwen3", num_layers=layers, dtype="float16", max_position_embeddings=4096)
    hw = load_hardware(hardware)
    if hw.gpu is None:
        raise SystemExit(f"{hardware}: expected a hardware profile with a GPU, found none")
    searched = search(model_dir, hw)
    plan = searched.replace(cpu_units=CPU_UNITS, candidates=())   # no candidates: the split is given
    r = run_pipeline(model_dir, hw, bundle_dir, copy_weights=True, plan=plan, quiet=True)
    print(f"built {r.bundle_dir}: {r.plan.describe()} (search chose {searched.describe()}), max context "
          f"{r.plan.memory.max_context}, for {hw.gpu.arch} in {time.time() - t0:.1f}s")
    return r.bundle_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--hardware", default=DEFAULT_PROFILE, help="hardware profile of the GPU machine")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    build(a.dir, a.hardware, a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
