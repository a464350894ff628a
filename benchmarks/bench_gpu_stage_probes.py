"""GEMV and GEMM probes of a prebuilt GPU stage on the GPU machine, at Qwen3-8B's MLP shape (fp16 weights
[12288, 4096]), beside cuBLAS on the same weight and the device's own copy rate; and the weight upload's rate.

    python -m benchmarks.bench_gpu_stage_probes STAGE_DIR [--out FILE.json]

STAGE_DIR from `python -m tests.device.build_gpu_stage STAGE_DIR` (compiler machine); runs with the runtime-only
TVM (no compiler, no NVRTC) and CuPy. Correctness is pytest's: `pytest -m gpu tests/runtime/test_gpu_stage_prebuilt.py`.
  - probe_gemv [1, 4096] and probe_prefill [128, 4096] @ the weight: us per call, GB/s of weight bytes, TFLOP/s;
  - cuBLAS (CuPy's fp16 matmul) on the same shapes;
  - a device-to-device copy of 256 MiB (read + write GB/s): the bar for the GEMV's weight rate;
  - PinnedUploader: a 1 GiB pageable host array (as an mmapped safetensors file) through its 64 MiB double-buffered
    pinned staging, GB/s.
Times: the median over 7 groups of the mean of 10 back-to-back calls, a whole-device synchronize around each group.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

PROBE_K, PROBE_N, PROBE_SEQ = 4096, 12288, 128


def time_device(fn, inner=10, repeats=7) -> float:
    """Median over `repeats` of the mean seconds per call over `inner` back-to-back calls (TVM and CuPy both use
    the legacy default stream)."""
    import cupy as cp

    for _ in range(3):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        cp.cuda.runtime.deviceSynchronize()
        times.append((time.perf_counter() - t) / inner)
    return float(np.median(times))


def measure(stage_dir: str) -> dict:
    import cupy as cp

    from helmc.runtime.cuda_runtime import PinnedUploader, cupy_to_tvm, load_gpu_vm, tvm_to_cupy
    vm = load_gpu_vm(os.path.join(stage_dir, "check_stage.so"), os.path.join(stage_dir, "check_stage.cubins.json"))
    report = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    rs = cp.random.RandomState(0)
    w = cupy_to_tvm((rs.standard_normal((PROBE_N, PROBE_K), dtype=cp.float32) * 0.02).astype(cp.float16))
    src = cp.empty(1 << 28, cp.uint8)
    dst = cp.empty_like(src)
    report["d2d_copy_gbs"] = 2 * src.nbytes / time_device(lambda: dst.__setitem__(Ellipsis, src)) / 1e9
    w_bytes = PROBE_N * PROBE_K * 2
    wt = tvm_to_cupy(w).T
    for name, seq, cublas in (("probe_gemv", 1, "cublas_gemv"), ("probe_prefill", PROBE_SEQ, "cublas_prefill")):
        x = cupy_to_tvm(rs.standard_normal((seq, PROBE_K), dtype=cp.float32).astype(cp.float16))
        xh = tvm_to_cupy(x)
        f = vm[name]
        for row, fn in ((name, lambda: f(x, w)), (cublas, lambda: xh @ wt)):
            sec = time_device(fn)
            report[row] = {"us": sec * 1e6, "weight_gbs": w_bytes / sec / 1e9,
                           "tflops": 2 * seq * PROBE_N * PROBE_K / sec / 1e12}
            print(f"{row:15s} [{seq}x{PROBE_K}] @ [{PROBE_K}x{PROBE_N}] fp16: {sec * 1e6:8.1f} us, "
                  f"{report[row]['weight_gbs']:5.0f} GB/s of weights, {report[row]['tflops']:5.1f} TFLOP/s")
    print(f"device-to-device copy (read+write): {report['d2d_copy_gbs']:.0f} GB/s")
    block = np.random.default_rng(1).integers(0, 1 << 16, size=(1 << 20,), dtype=np.uint16)
    host = np.tile(block, 512)                                                   # [2^29] uint16: 1 GiB
    up = PinnedUploader()
    t = time.perf_counter()
    up.upload(host.reshape(1 << 15, 1 << 14), dtype="bfloat16")
    up.synchronize()
    sec = time.perf_counter() - t
    report["upload"] = {"bytes": host.nbytes, "s": sec, "gbs": host.nbytes / sec / 1e9}
    print(f"PinnedUploader 1 GiB host -> device: {host.nbytes / sec / 1e9:.1f} GB/s")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the stage from tests.device.build_gpu_stage")
    ap.add_argument("--out")
    a = ap.parse_args()
    report = measure(a.dir)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
