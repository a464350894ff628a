"""Build, on the compiler machine, the split bundles that tests/runtime/test_batch_decode_gpu.py runs on the GPU.

    python -m tests.device.build_batch_session_bundles .devrt/batch_session [--hardware PROFILE]

One tiny random-weight Qwen3 (hidden 256, ffn 512: whole K-quant blocks; helmc.testing) in fp16 and bf16, and
the fp16 one quantized at build to q4_k_m and q8_0; each built for the GPU test machine's profile (default
helmc/hardware/presets/h100-sxm-measured.json, sm_90) with --max-batch 4 (so decode_b2 / decode_b4 variants), weights
copied in, and the split forced to cpu(2) -> cuda(rest): block 0 on the CPU, the others and the head on the GPU,
so a batched decode step crosses both stages; fp16_streamed is fp16 with the CPU block's prefill streamed to the GPU
(plan.placement.prefill_on_gpu, as a real split's); fp16_hybrid is fp16 with a hybrid decode layout (block 0 on the CPU, blocks 1-2
streamed to the GPU every step, block 3 resident). Writes DIR/<name>/bundle for name in fp16, bf16, q4_k_m, q8_0,
fp16_streamed, fp16_hybrid
(the model directory made for it is deleted once its weights are in the bundle); carry .devrt to the GPU machine (the test looks in $HELMC_GPU_BATCH_BUNDLES, default
.devrt/batch_session). Regenerate by running this again.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_PROFILE = os.path.join(ROOT, "helmc", "hardware", "presets", "h100-sxm-measured.json")
CPU_UNITS = 2                      # embedding + block 0 on the CPU
BATCH = 4
DIMS = dict(num_layers=4, head_dim=64, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)
VARIANTS = {"fp16": ("float16", ""), "bf16": ("bfloat16", ""), "q4_k_m": ("float16", "q4_k_m"),
            "q8_0": ("float16", "q8_0"), "fp16_streamed": ("float16", "")}
STREAMED = {"fp16_streamed"}       # the CPU block's prefill streamed to the GPU (plan.placement.prefill_on_gpu)
VARIANTS["fp16_hybrid"] = ("float16", "")
# hybrid decode: block 0 on the CPU, blocks 1-2 streamed over PCIe every step (a ring of two blocks, which holds the
# joint prefill's loan: cost_model.ring_hosts_loan), block 3 resident
HYBRID = {"fp16_hybrid": ((1, 2),)}


def build(out_dir: str, hardware: str) -> list[str]:
    from helmc.compiler.pipeline import build as run_pipeline
    from helmc.compiler.read_model import read_model
    from helmc.hardware.profile import load_hardware
    from helmc.planner.analyze_program import analyze_program
    from helmc.planner.search_partition import plan as search
    from helmc.testing import make_tiny_model

    hw = load_hardware(hardware)
    if hw.gpu is None:
        raise SystemExit(f"{hardware}: expected a hardware profile with a GPU, found none")
    built = []
    with tempfile.TemporaryDirectory(prefix="helmc-batch-bundles-") as cache:
        for name, (dtype, quant) in VARIANTS.items():
            t0 = time.time()
            model_dir, bundle_dir = os.path.join(out_dir, name, "model"), os.path.join(out_dir, name, "bundle")
            for d in (model_dir, bundle_dir):
                if os.path.isdir(d):
                    shutil.rmtree(d)
            make_tiny_model(model_dir, "qwen3", dtype=dtype, **DIMS)
            spec = read_model(model_dir, quant, os.path.join(cache, "weights")).spec
            searched = search(spec, hw, batch=BATCH)
            plan = searched.replace(cpu_units=CPU_UNITS, candidates=())   # the split is given
            if name in HYBRID:
                from helmc.planner.hybrid import forced_layout
                plan = forced_layout(searched, spec, HYBRID[name])
            if name in STREAMED:
                block = max(u.stored_bytes for u in analyze_program(spec).units if u.kind == "block")
                plan = plan.replace(prefill_on_gpu=True, prefill_staging_bytes=block)
            r = run_pipeline(model_dir, hw, bundle_dir, copy_weights=True, plan=plan, quiet=True, quant=quant,
                             cache_dir=cache, batch=BATCH)
            shutil.rmtree(model_dir)        # the bundle holds its weights: less to carry
            print(f"built {r.bundle_dir}: {r.plan.describe()}, batch {r.plan.workload.batch}, for {hw.gpu.arch} "
                  f"in {time.time() - t0:.1f}s")
            built.append(r.bundle_dir)
    return built


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--hardware", default=DEFAULT_PROFILE, help="hardware profile of the GPU machine")
    a = ap.parse_args(argv)
    build(a.dir, a.hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
