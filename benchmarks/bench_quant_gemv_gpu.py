"""The quantized-weight CUDA kernels (schedules/gpu/quant_gemv.py, quant_gemv_int8.py) timed on the GPU machine at
Qwen3-8B's projection shapes, with each one's error against float64.

    python -m benchmarks.bench_quant_gemv_gpu DIR [--out FILE.json]

DIR from `python -m tests.device.build_quant_gpu_kernels DIR` (compiler machine); runs with the runtime-only TVM
(helmc.runtime.cuda_runtime: no compiler, no NVRTC; CuPy only for memory and events). Every kernel: its max relative
error (max |y - ref| / max |ref|) and its time per call (CUDA events around each of CALLS calls queued back to back,
median; the weights rotate over copies larger than the L2 so every call reads HBM) with GB/s of quantized bytes,
then one table; exits 1 if an error exceeds the tolerance. The pass/fail check is pytest's:
`pytest -m gpu tests/kernels/test_quant_gemv_gpu.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from tests.device.build_quant_gpu_kernels import INT8_TOLERANCE, TOLERANCE
from tests.quant_rows import rel_err

CALLS = 50
L2_DEFEAT_BYTES = 256 << 20   # rotate over this many bytes of copies (H100 L2: 50 MB)
FILL_BYTES = 1 << 30          # device copy queued before timing, so all CALLS launches queue behind it


def untimed(launch) -> tuple[float, bool]:
    """A timer that only launches once (the correctness test's)."""
    launch(0)
    return float("nan"), True


class Timer:
    """Time per call of a launch: CUDA events between CALLS launches queued behind FILL_BYTES of copy, so the
    GPU runs them back to back and no host launch gap lands inside an interval (TVM and CuPy share the legacy
    default stream). `queued` tells whether all launches were indeed queued before the first ran."""

    def __init__(self):
        import cupy as cp

        self.cp = cp
        self.src, self.dst = cp.empty(FILL_BYTES, cp.uint8), cp.empty(FILL_BYTES, cp.uint8)

    def __call__(self, launch) -> tuple[float, bool]:
        cp = self.cp
        for i in range(3):
            launch(i)
        cp.cuda.runtime.deviceSynchronize()
        events = [cp.cuda.Event() for _ in range(CALLS + 1)]
        for _ in range(2):
            self.dst.data.copy_from_device_async(self.src.data, FILL_BYTES)
        events[0].record()
        for i in range(CALLS):
            launch(i)
            events[i + 1].record()
        queued = not events[0].done
        events[-1].synchronize()
        per_call = [cp.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e-3 for i in range(CALLS)]
        return float(np.median(per_call)), queued


def run_group(mod, d: str, manifest: dict, qtype: str, n: int, k: int, entries: list[dict], timer) -> list[dict]:
    """Every kernel of one (qtype, n, k): error against the references, then time per call."""
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm

    unique = manifest["unique_rows"]
    pick = np.arange(n) % unique                                        # row r of the weight is unique row r % U
    w_host = np.ascontiguousarray(np.load(os.path.join(d, f"w_{qtype}_k{k}.npy"))[pick])  # [n, row_bytes]
    ref = np.load(os.path.join(d, f"ref_{qtype}_k{k}.npy"))[pick]                          # [n] float64
    dense = np.load(os.path.join(d, f"dense_{qtype}_k{k}.npy"))                            # [CHECK_ROWS, k]
    x_host = np.load(os.path.join(d, f"x_k{k}.npy"))
    w_bytes = w_host.nbytes
    copies = max(2, -(-L2_DEFEAT_BYTES // w_bytes))
    w_dev = [cp.asarray(w_host)]
    for _ in range(copies - 1):
        w_dev.append(cp.empty_like(w_dev[0]))
        w_dev[-1].data.copy_from_device_async(w_dev[0].data, w_bytes)
    w_tvm = [cupy_to_tvm(w) for w in w_dev]
    x_tvm = cupy_to_tvm(cp.asarray(x_host.reshape(1, k)))              # [k] -> [1, k]
    results = []
    for e in entries:
        f = mod[e["symbol"]]
        if e["kind"] in ("gemv", "gemv8"):
            y_dev = cp.zeros((1, n), cp.float16)
            y_tvm = cupy_to_tvm(y_dev)
            f(x_tvm, w_tvm[0], y_tvm)
            err = rel_err(cp.asnumpy(y_dev).reshape(n), ref)
            sec, queued = timer(lambda i: f(x_tvm, w_tvm[i % copies], y_tvm))
            moved = w_bytes
        else:
            out_copies = max(2, min(copies, -(-L2_DEFEAT_BYTES // (w_bytes + 2 * n * k))))
            out_dev = [cp.zeros((n, k), cp.float16) for _ in range(out_copies)]
            outs = [cupy_to_tvm(o) for o in out_dev]
            f(w_tvm[0], outs[0])
            got = cp.asnumpy(out_dev[0])                                # [n, k] fp16
            err_rows = rel_err(got[:dense.shape[0]], dense.astype(np.float64))
            err_dot = rel_err(got.astype(np.float32) @ x_host.astype(np.float32), ref)
            err = max(err_rows, err_dot)
            sec, queued = timer(lambda i: f(w_tvm[i % copies], outs[i % out_copies]))
            moved = w_bytes + 2 * n * k
            del outs, out_dev
        r = dict(e, max_rel_err=err, us=sec * 1e6, quant_gbs=w_bytes / sec / 1e9, moved_gbs=moved / sec / 1e9,
                 queued=queued, ok=bool(err <= (INT8_TOLERANCE if e["kind"] == "gemv8" else TOLERANCE)))
        tune = "" if e["tuning"] is None else " r{}w{}u{}".format(*e["tuning"]) + ("s" if e["tuning"][3:] else "")
        print(f"{e['kind']:10s} {qtype} {n}x{k}{tune}: max rel err {err:.2e} {'ok' if r['ok'] else 'FAIL'}, "
              f"{sec * 1e6:.1f} us, {r['quant_gbs']:.0f} GB/s of quantized bytes"
              + (f", {r['moved_gbs']:.0f} GB/s read+written" if e["kind"] == "dequantize" else "")
              + ("" if queued else " (launch-bound: the GPU caught up with the launches)"), flush=True)
        results.append(r)
    del w_dev, w_tvm
    cp.get_default_memory_pool().free_all_blocks()
    return results


def measure(d: str, out_path: str | None) -> int:
    import cupy as cp

    from helmc.runtime.cuda_runtime import load_gpu_executable

    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    t0 = time.time()
    mod = load_gpu_executable(os.path.join(d, manifest["library"]), os.path.join(d, manifest["cubin_index"]))
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"loaded {len(manifest['kernels'])} kernels in {time.time() - t0:.2f}s on {device}")
    timer = Timer()
    groups: dict[tuple, list[dict]] = {}
    for e in manifest["kernels"]:
        groups.setdefault((e["qtype"], e["n"], e["k"]), []).append(e)
    results = []
    for (qtype, n, k), entries in groups.items():
        results += run_group(mod, d, manifest, qtype, n, k, entries, timer)

    ok = all(r["ok"] for r in results)
    print(f"\n{'type':5s} {'n x k':>11s} {'max err':>8s} | {'gemv us':>7s} {'GB/s':>5s} {'best tuning, GB/s':>17s} | "
          f"{'deq us':>7s} {'GB/s':>5s} {'r+w GB/s':>8s}   (GB/s: quantized bytes per second)")
    for key in groups:
        mine = [r for r in results if (r["qtype"], r["n"], r["k"]) == key]
        gemv = next(r for r in mine if r["kind"] == "gemv" and r["tuning"] is None)
        deq = next(r for r in mine if r["kind"] == "dequantize")
        tuned = [r for r in mine if r["tuning"] is not None and r["kind"] == "gemv"]
        int8 = sorted((r for r in mine if r["kind"] == "gemv8"), key=lambda r: -r["quant_gbs"])
        int8_s = ("  int8 x: default {:.1f} us {:.0f} GB/s, best {} {:.1f} us {:.0f} GB/s".format(
            next(r for r in int8 if r["tuning"] is None)["us"], next(r for r in int8 if r["tuning"] is None)["quant_gbs"],
            "r{}w{}u{}".format(*(int8[0]["tuning"] or manifest["int8_default_tuning"]))
            + ("s" if (int8[0]["tuning"] or [])[3:] else ""), int8[0]["us"],
            int8[0]["quant_gbs"]) if int8 else "")
        best = max(tuned, key=lambda r: r["quant_gbs"]) if tuned else None
        best_s = "r{}w{}u{} ".format(*best["tuning"]) + f"{best['quant_gbs']:.0f}" if best else "-"
        flags = ("" if all(r["ok"] for r in mine) else "  FAIL") + ("" if all(r["queued"] for r in mine) else "  *")
        print(f"{key[0]:5s} {key[1]:>5d}x{key[2]:<5d} {max(r['max_rel_err'] for r in mine):8.1e} | "
              f"{gemv['us']:7.1f} {gemv['quant_gbs']:5.0f} {best_s:>17s} | "
              f"{deq['us']:7.1f} {deq['quant_gbs']:5.0f} {deq['moved_gbs']:8.0f}{flags}{int8_s}")
    print("default tuning r{}w{}u{} (rows_per_warp, warps, unroll); ".format(*manifest["default_tuning"])
          + f"tolerance {TOLERANCE:g} (max |y - ref| / max |ref|); "
          f"* = some timing launch-bound; {'OK' if ok else 'FAILED'}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": device, "tolerance": TOLERANCE, "ok": ok, "results": results}, f, indent=1)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the kernels from tests.device.build_quant_gpu_kernels")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    return measure(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
