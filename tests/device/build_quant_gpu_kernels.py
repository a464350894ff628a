"""Build, on the compiler machine (compiler venv, gguf, nvcc), the quantized-weight CUDA kernels and their data that
tests/kernels/test_quant_gemv_gpu.py checks and benchmarks/bench_quant_gemv_gpu.py times on the GPU.

    python -m tests.device.build_quant_gpu_kernels .devrt/quant_gpu_check [--arch sm_90]

The decode GEMV and the dequantizer of every type (q8_0, q4_0, q5_0, q3_k, q4_k, q5_k, q6_k, iq4_xs, mxfp4;
schedules/gpu/quant_gemv.py) for n x k in SHAPES, the int8-activation GEMV (quant_gemv_int8.py: q3_k, q4_k, q5_k,
q6_k) at its default and INT8_VARIANTS, plus the GEMV at other tunings (VARIANTS) at two shapes, in one library built with helmc's compile_gpu_stage
(quant_kernels.so, its cubin and cubin index), and the data: per type and k, UNIQUE_ROWS random valid rows
(tests/quant_rows.py), x (fp16) per k, and float64 references (gguf's numpy dequantizer, @ x in float64). A weight
of n rows is these rows repeated (row r is row r % UNIQUE_ROWS, a prime, so a kernel that reads the wrong row of
its group still differs): DIR stays small enough to carry (~19 MiB). The test looks in $HELMC_QUANT_GPU_DIR
(default .devrt/quant_gpu_check).

TOLERANCE = 2e-3, not 1e-2: the reference multiplies the same fp16 x, so fp16 activations cost nothing here;
what remains is fp32 summation (~1e-6) and the single rounding of y (or of each dequantized weight) to fp16,
at most 2^-11 = 4.9e-4 of max |ref|. 2e-3 leaves 4x of margin over that and still fails a kernel with one
wrong sub-block scale per row, which 1e-2 could let pass.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from tests.quant_rows import dequantize_reference, random_quant_rows

QTYPES = ("q8_0", "q4_0", "q5_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4")
SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))      # Qwen3-8B's q/o, gate/up and down projections
# GEMV tunings (rows_per_warp, warps, unroll) timed beside the default (2, 4, 2), at a short and a long row
VARIANT_SHAPES = ((4096, 4096), (4096, 12288))
VARIANTS = ((1, 4, 4), (2, 4, 4), (4, 4, 2))
# the int8-activation GEMV (quant_gemv_int8.py, its INT8_TYPES): its default (2, 4, 2) and these, at every shape
# (rows per warp, warps, unroll[, k_split]): k_split variants (warps share rows, each takes every warps-th step of
# their blocks) for the short row counts (q/k/v, o, down: 256 CTAs of 16 rows on 132 SMs at (2, 8, 2))
INT8_VARIANTS = ((4, 4, 2), (2, 8, 2), (4, 8, 1), (1, 4, 4), (8, 4, 1),
                 (2, 4, 2, True), (4, 4, 2, True), (2, 8, 1, True), (4, 8, 1, True), (8, 4, 1, True))
INT8_TOLERANCE = 2e-2     # against the fp16-x reference: the int8 activations' own ~0.5% (emulated tests: 2e-3)
UNIQUE_ROWS = 251
CHECK_ROWS = 8            # rows of the dequantizer's output compared element by element
TOLERANCE = 2e-3
LIB = "quant_kernels"


def kernel_entries() -> list[dict]:
    from helmc.schedules.gpu.quant_gemv import dequantize_symbol, gemv_symbol
    from helmc.schedules.gpu.quant_gemv_int8 import INT8_TYPES, gemv_int8_symbol

    out = []
    for qtype in QTYPES:
        for n, k in SHAPES:
            if qtype in INT8_TYPES:
                for tuning in (None,) + INT8_VARIANTS:
                    out.append({"kind": "gemv8", "qtype": qtype, "n": n, "k": k, "tuning": tuning and list(tuning),
                                "symbol": gemv_int8_symbol(qtype, n, k, *(tuning or ()))})
            out.append({"kind": "gemv", "qtype": qtype, "n": n, "k": k, "tuning": None,
                        "symbol": gemv_symbol(qtype, n, k)})
            out.append({"kind": "dequantize", "qtype": qtype, "n": n, "k": k, "tuning": None,
                        "symbol": dequantize_symbol(qtype, n, k)})
        for (n, k), tuning in ((shape, t) for shape in VARIANT_SHAPES for t in VARIANTS):
            out.append({"kind": "gemv", "qtype": qtype, "n": n, "k": k, "tuning": list(tuning),
                        "symbol": gemv_symbol(qtype, n, k, *tuning)})
    return out


def build(out_dir: str, arch: str) -> None:
    import tvm

    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage
    from helmc.schedules.gpu.quant_gemv import make_gpu_dequantize, make_gpu_gemv_quant
    from helmc.schedules.gpu.quant_gemv_int8 import make_gpu_gemv_int8

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    entries = kernel_entries()
    funcs = {}
    for e in entries:
        if e["kind"] == "gemv":
            funcs[e["symbol"]] = make_gpu_gemv_quant(e["qtype"], e["n"], e["k"], *(e["tuning"] or ()))
        elif e["kind"] == "gemv8":
            funcs[e["symbol"]] = make_gpu_gemv_int8(e["qtype"], e["n"], e["k"], *(e["tuning"] or ()))
        else:
            funcs[e["symbol"]] = make_gpu_dequantize(e["qtype"], e["n"], e["k"])
    files = compile_gpu_stage(tvm.IRModule(funcs), arch, out_dir, name=LIB)
    t1 = time.time()

    rng = np.random.default_rng(0)
    for k in sorted({k for _, k in SHAPES}):
        x = rng.standard_normal(k).astype(np.float16)
        np.save(os.path.join(out_dir, f"x_k{k}.npy"), x)
        for qtype in QTYPES:
            rows = random_quant_rows(qtype, UNIQUE_ROWS, k, rng)
            dense = dequantize_reference(qtype, rows)                                  # [UNIQUE_ROWS, k]
            np.save(os.path.join(out_dir, f"w_{qtype}_k{k}.npy"), rows)
            np.save(os.path.join(out_dir, f"ref_{qtype}_k{k}.npy"), dense.astype(np.float64) @ x.astype(np.float64))
            np.save(os.path.join(out_dir, f"dense_{qtype}_k{k}.npy"), dense[:CHECK_ROWS])
    from helmc.schedules.gpu import quant_gemv_int8 as i8
    from helmc.schedules.gpu.quant_gemv import ROWS_PER_WARP, UNROLL, WARPS

    manifest = {"arch": arch, "library": f"{LIB}.so", "cubin_index": f"{LIB}.cubins.json",
                "default_tuning": [ROWS_PER_WARP, WARPS, UNROLL],
                "int8_default_tuning": [i8.ROWS_PER_WARP, i8.WARPS, i8.UNROLL],
                "unique_rows": UNIQUE_ROWS, "check_rows": CHECK_ROWS, "tolerance": TOLERANCE, "kernels": entries}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(os.path.join(out_dir, p)) for p in os.listdir(out_dir))
    print(f"built {len(funcs)} kernels {files} for {arch} in {out_dir}: compile+nvcc {t1 - t0:.1f}s, "
          f"data {time.time() - t1:.1f}s, {size / 2**20:.1f} MiB in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    build(a.out, a.arch)


if __name__ == "__main__":
    main()
