"""All-GPU bundles of one model, one per one-row GPU GEMV tuning (schedules/gpu/gemv.py M1_TUNING), to run side by
side on the GPU machine with `scripts/bench_decode.py --bundle A --bundle B ...` beside llama-bench -ngl 99 (issue 16:
fp16 Qwen3-8B decode at 1.1x llama.cpp's needs ~3% off a 4.69 ms step on an H200, session 17, where the fp16 GEMVs
read 3.80-3.86 TB/s of a 4.13-4.31 TB/s HBM). Every variant keeps 4 warps, so its outputs are bit-identical to the
default's (the per-row sums depend on warps only).

    python experiments/gpu_gemv_tunings.py MODEL_DIR HARDWARE.json OUT_DIR [--only NAME,...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (tuning of the plain and residual GEMVs, tuning of the SwiGLU pair), each (rows per warp, warps, unroll)
VARIANTS = {
    "default": None,
    "r2u8": ((2, 4, 8), (1, 4, 8)),       # twice the 16-byte loads in flight per warp
    "r4u4": ((4, 4, 4), (2, 4, 4)),       # twice the rows per block: half the blocks, each x load for more rows
    "r1u8": ((1, 4, 8), (1, 4, 8)),       # twice the blocks, as many loads in flight per warp as r2u4
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("hardware")
    ap.add_argument("out")
    ap.add_argument("--only", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    from helmc import api
    from helmc.schedules.gpu import gemv
    for name in a.only.split(","):
        tunings = VARIANTS[name]
        gemv.M1_TUNING.clear()
        if tunings is not None:
            gemv.M1_TUNING.update({None: tunings[0], "residual": tunings[0], "swiglu": tunings[1]})
        t = time.perf_counter()
        # a cache per variant: the build cache keys kernels by name, and a tuning keeps the default's names
        api.build(a.model, a.hardware, os.path.join(a.out, f"gpu_{name}"), quiet=True,
                  cache_dir=os.path.join(a.out, f".cache_{name}"))
        print(f"{name}: {gemv.M1_TUNING or 'default'} built in {time.perf_counter() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
