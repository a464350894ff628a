"""Build, on the compiler machine, the bundles that tests/hybrid/test_hybrid_gpu.py runs on the GPU.

    python -m tests.device.build_hybrid_bundles .devrt/hybrid [--hardware PROFILE]

One tiny random-weight Qwen3 (fp16, 6 blocks; helmc.testing), built for the GPU test machine's profile (default
helmc/hardware/presets/h100-sxm-measured.json, sm_90) with weights copied in and the plans forced (the search would put
a model this small wholly on the GPU), prefill chunks of 8 tokens, every host block's prefill streamed to the GPU:

    hybrid1     C0 [0] S0 [1] | resident [2..5]                    (cpu_units 3)
    hybrid2     C0 [0] S0 [1] C1 [2] S1 [3] | resident [4, 5]      (cpu_units 5)
    hybrid_all  C0 [0] S0 [1, 2] C1 [3] S1 [4, 5] | head only      (cpu_units 7: no resident block)
    split2, split3, split5, split7   the plain splits cpu(k) -> cuda(rest)

plus DIR/refs.json: the prompt, HF transformers' greedy tokens (fp32 on the fp16 weights) and its last prompt logits.
The artifact cache is shared between the builds, so the CPU and GPU libraries compile once. Carry .devrt to the GPU
machine; the test looks in $HELMC_GPU_HYBRID_BUNDLES (default .devrt/hybrid). Regenerate by running this again.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_PROFILE = os.path.join(ROOT, "helmc", "hardware", "presets", "h100-sxm-measured.json")
LAYERS, PROMPT_LEN, NEW_TOKENS, CHUNK = 6, 40, 24, 8
LAYOUTS = {"hybrid1": ((1, 1),), "hybrid2": ((1, 1), (1, 1)), "hybrid_all": ((1, 2), (1, 2))}
SPLITS = {"split2": 2, "split3": 3, "split5": 5, "split7": 7}
# hybrid bundle -> the plain splits its greedy tokens must equal: the same host blocks (cpu_units), and for
# hybrid1 also cpu(2), where its streamed block is GPU-resident
SAME_TOKENS = {"hybrid1": ("split3", "split2"), "hybrid2": ("split5",), "hybrid_all": ("split7",)}


def build(out_dir: str, hardware: str) -> None:
    import numpy as np

    from helmc.compiler.pipeline import build as run_pipeline
    from helmc.hardware.profile import load_hardware
    from helmc.model.load import load_spec
    from helmc.planner.hybrid import forced_layout, forced_split
    from helmc.runtime.bundle.plan import Plan
    from helmc.testing import hf_prompt_reference, make_tiny_model

    hw = load_hardware(hardware)
    if hw.gpu is None:
        raise SystemExit(f"{hardware}: expected a hardware profile with a GPU, found none")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="helmc-hybrid-") as work:
        model_dir = os.path.join(work, "model")
        model = make_tiny_model(model_dir, "qwen3", num_layers=LAYERS, dtype="float16", seed=5, head_dim=32,
                                hidden_size=128, intermediate_size=384, max_position_embeddings=4096).float()
        spec = load_spec(model_dir)
        base = Plan.of(num_layers=LAYERS, cpu_units=0, max_context=512,
                    prefill_chunk_tokens=CHUNK, gpu_kv_pool_bytes=64 << 20)
        plans = {name: forced_layout(base, spec, pairs) for name, pairs in LAYOUTS.items()}
        plans.update({name: forced_split(base, spec, k) for name, k in SPLITS.items()})
        cache = os.path.join(work, "cache")
        for name, plan in plans.items():
            r = run_pipeline(model_dir, hw, os.path.join(out_dir, name), plan=plan, copy_weights=True, quiet=True,
                             cache_dir=cache)
            print(f"  {name}: {r.plan.describe()}")
        prompt = np.random.default_rng(3).integers(1, spec.vocab_size, PROMPT_LEN).tolist()
        logits, greedy = hf_prompt_reference(model, prompt, NEW_TOKENS)
    with open(os.path.join(out_dir, "refs.json"), "w") as f:
        json.dump({"prompt": prompt, "greedy": [int(t) for t in greedy], "logits": [float(v) for v in logits],
                   "same_tokens": SAME_TOKENS}, f)
    print(f"built {len(plans)} bundles and refs.json under {out_dir} for {hw.gpu.arch} in {time.time() - t0:.1f}s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--hardware", default=DEFAULT_PROFILE, help="hardware profile of the GPU machine")
    a = ap.parse_args(argv)
    build(a.dir, a.hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
