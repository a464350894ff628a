"""Build, on the compiler machine (nvcc), the paged attention cubins tests/kernels/test_flash_prefill_gpu.py and
benchmarks/bench_flash_prefill.py load on the GPU: the decode kernels and flash_prefill
(schedules/gpu/flash_prefill.py) for (head_dim, group) = (128, 4) (Qwen3-8B/14B), (64, 2), (128, 1), (256, 2) (Gemma 3 12B: 66 KB of
dynamic shared memory) and (64, 8) (gpt-oss: its attention sinks' cases), one
sub-directory each (DIR/d128_g4/paged_attention.cubin, ...), as `helmc build` compiles them into a bundle.

    python -m tests.device.build_flash_prefill_cubins .devrt/flash_check [--arch sm_90]

Carry DIR to the GPU machine; the test looks in $HELMC_FLASH_PREFILL_DIR (default .devrt/flash_check).
"""
from __future__ import annotations

import argparse
import os

SHAPES = ((128, 4), (64, 2), (128, 1), (256, 2), (64, 8))


def cubin_paths(dir_: str) -> dict:
    """(head_dim, group) -> the cubin this builder wrote under `dir_` (CudaOps' argument)."""
    return {(d, g): os.path.join(dir_, f"d{d}_g{g}", "paged_attention.cubin") for d, g in SHAPES}


def build(out_dir: str, arch: str) -> None:
    from helmc.compiler.passes.compile_gpu_stage import compile_paged_attention
    for (d, g), path in cubin_paths(out_dir).items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        compile_paged_attention(d, g, arch, os.path.dirname(path))
        print(f"built {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    build(a.out, a.arch)


if __name__ == "__main__":
    main()
