#!/usr/bin/env python3
"""Check the quantized-weight CUDA kernels (schedules/gpu/quant_gemv.py) on the GPU machine: error and speed.

Two modes:

  --build DIR [--arch sm_90]   (here, with the compiler venv, gguf and nvcc) builds the decode GEMV and the
      dequantizer of every type (q8_0, q4_0, q5_0, q3_k, q4_k, q5_k, q6_k) for n x k in SHAPES, plus the GEMV at other tunings
      (VARIANTS) at two shapes, into one library with helmc's compile_gpu_stage (quant_kernels.so, its cubin and
      cubin index), and writes the data: per type and k, UNIQUE_ROWS random valid rows (q8_0 / q4_0 quantized
      from Gaussians by gguf.quants.quantize; q4_k / q6_k random bytes with their fp16 scale fields set to small
      finite values), x (fp16) per k, and float64 references (gguf's numpy dequantizer, @ x in float64). A
      weight of n rows is these rows repeated (row r is row r % UNIQUE_ROWS, a prime, so a kernel that reads
      the wrong row of its group still differs): DIR stays small enough to carry (~19 MiB).

  DIR [--out FILE]   (GPU machine, runtime-only TVM: TVM_USE_RUNTIME_LIB=1, PYTHONPATH=<checkout>:.devrt/site)
      loads DIR with helmc.runtime.cuda_runtime (no compiler, no NVRTC; CuPy only for memory and events), runs
      every kernel, prints its max relative error (max |y - ref| / max |ref|) and its time per call (CUDA
      events around each of CALLS calls queued back to back, median; the weights rotate over copies larger
      than the L2 so every call reads HBM) with GB/s of quantized bytes, then one table. Exits 1 if any error
      exceeds TOLERANCE.

  Here:  . .venv/bin/activate && python tests/device/device_quant_gpu_check.py --build .devrt/quant_gpu_check
  There (device tool, carry [".devrt/site", ".devrt/quant_gpu_check"]):
    bash scripts/device_run.sh py=tests/device/device_quant_gpu_check.py,.devrt/quant_gpu_check,--out,$OUT/quant.json

TOLERANCE = 2e-3, not 1e-2: the reference multiplies the same fp16 x, so fp16 activations cost nothing here;
what remains is fp32 summation (~1e-6) and the single rounding of y (or of each dequantized weight) to fp16,
at most 2^-11 = 4.9e-4 of max |ref|. 2e-3 leaves 4x of margin over that and still fails a kernel with one
wrong sub-block scale per row, which 1e-2 could let pass.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

QTYPES = ("q8_0", "q4_0", "q5_0", "q3_k", "q4_k", "q5_k", "q6_k")
SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))      # Qwen3-8B's q/o, gate/up and down projections
# GEMV tunings (rows_per_warp, warps, unroll) timed beside the default (2, 4, 2), at a short and a long row
VARIANT_SHAPES = ((4096, 4096), (4096, 12288))
VARIANTS = ((1, 4, 4), (2, 4, 4), (4, 4, 2))
# the int8-activation GEMV (quant_gemv_int8.py, q4_k / q6_k): its default (2, 4, 2) and these, at every shape
# (rows per warp, warps, unroll[, k_split]): k_split variants (warps share rows, each takes every warps-th step of
# their blocks) for the short row counts (q/k/v, o, down: 256 CTAs of 16 rows on 132 SMs at (2, 8, 2))
INT8_VARIANTS = ((4, 4, 2), (2, 8, 2), (4, 8, 1), (1, 4, 4), (8, 4, 1),
                 (2, 4, 2, True), (4, 4, 2, True), (2, 8, 1, True), (4, 8, 1, True), (8, 4, 1, True))
INT8_TOLERANCE = 2e-2     # against the fp16-x reference: the int8 activations' own ~0.5% (emulated tests: 2e-3)
UNIQUE_ROWS = 251
CHECK_ROWS = 8            # rows of the dequantizer's output compared element by element
TOLERANCE = 2e-3
CALLS = 50
L2_DEFEAT_BYTES = 256 << 20   # rotate over this many bytes of copies (H100 L2: 50 MB)
FILL_BYTES = 1 << 30          # device copy queued before timing, so all CALLS launches queue behind it
LIB = "quant_kernels"
_GGUF_TYPE = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q5_0": "Q5_0", "q3_k": "Q3_K", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


# ----------------------------------------------------------------------------------------------
# Build side (TVM compiler, gguf, nvcc)
# ----------------------------------------------------------------------------------------------
def random_quant_rows(qtype: str, rows: int, k: int, rng) -> np.ndarray:
    """uint8 [rows, row_bytes]: valid GGUF rows of `qtype` (every fp16 field finite, weights of order 1)."""
    from gguf import GGMLQuantizationType, quants

    from helmc.model.spec import QUANT_BLOCKS      # a plain table: runs where only TVM's runtime is (bench_cpu_gemv)

    block_weights, block_bytes = QUANT_BLOCKS[qtype]
    if qtype in ("q8_0", "q4_0", "q5_0"):
        dense = rng.standard_normal((rows, k)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(dense, GGMLQuantizationType[_GGUF_TYPE[qtype]]))
    blocks = rng.integers(0, 256, (rows, k // block_weights, block_bytes), dtype=np.uint8)  # [rows, blocks, bytes]

    def halves(lo, hi, signed):
        v = rng.uniform(lo, hi, (rows, k // block_weights))
        v = np.where(rng.random(v.shape) < 0.5, -v, v) if signed else v
        return v.astype(np.float16)[..., None].view(np.uint8)                            # [rows, blocks, 2]

    if qtype in ("q4_k", "q5_k"):   # d, dmin at bytes 0..3: w = d*sc*q - dmin*m, |w| <= 4e-3*63*31 < 8
        blocks[:, :, 0:2] = halves(1e-3, 4e-3, False)
        blocks[:, :, 2:4] = halves(1e-3, 4e-3, False)
    elif qtype == "q3_k":        # d at bytes 108..109, either sign: |w| <= 2e-3 * 32 * 4
        blocks[:, :, 108:110] = halves(5e-4, 2e-3, True)
    else:                        # q6_k: d at bytes 208..209, either sign (ggml's make_qx_quants gives both)
        blocks[:, :, 208:210] = halves(5e-4, 2e-3, True)
    return blocks.reshape(rows, -1)                                                      # [rows, row_bytes]


def dequantize_reference(qtype: str, rows_u8: np.ndarray) -> np.ndarray:
    """float32 [rows, k]: the weights the rows encode, by gguf's numpy dequantizer."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(rows_u8, GGMLQuantizationType[_GGUF_TYPE[qtype]]).astype(np.float32)


def _compile_gpu_stage():
    try:       # the compiler's passes live in helmc/compiler/passes/ (moved there from helmc/compiler/)
        from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage
    except ImportError:
        from helmc.compiler.compile_gpu_stage import compile_gpu_stage
    return compile_gpu_stage


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
    files = _compile_gpu_stage()(tvm.IRModule(funcs), arch, out_dir, name=LIB)
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


# ----------------------------------------------------------------------------------------------
# Device side (runtime-only TVM, CuPy for memory and events; numpy for every comparison)
# ----------------------------------------------------------------------------------------------
class _Timer:
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


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    got = got.astype(np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _check_group(mod, d: str, manifest: dict, qtype: str, n: int, k: int, entries: list[dict], timer) -> list[dict]:
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
            err = _rel(cp.asnumpy(y_dev).reshape(n), ref)
            sec, queued = timer(lambda i: f(x_tvm, w_tvm[i % copies], y_tvm))
            moved = w_bytes
        else:
            out_copies = max(2, min(copies, -(-L2_DEFEAT_BYTES // (w_bytes + 2 * n * k))))
            out_dev = [cp.zeros((n, k), cp.float16) for _ in range(out_copies)]
            outs = [cupy_to_tvm(o) for o in out_dev]
            f(w_tvm[0], outs[0])
            got = cp.asnumpy(out_dev[0])                                # [n, k] fp16
            err_rows = _rel(got[:dense.shape[0]], dense.astype(np.float64))
            err_dot = _rel(got.astype(np.float32) @ x_host.astype(np.float32), ref)
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


def check(d: str, out_path: str | None) -> int:
    import cupy as cp

    from helmc.runtime.cuda_runtime import load_gpu_executable

    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    t0 = time.time()
    mod = load_gpu_executable(os.path.join(d, manifest["library"]), os.path.join(d, manifest["cubin_index"]))
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"loaded {len(manifest['kernels'])} kernels in {time.time() - t0:.2f}s on {device}")
    timer = _Timer()
    groups: dict[tuple, list[dict]] = {}
    for e in manifest["kernels"]:
        groups.setdefault((e["qtype"], e["n"], e["k"]), []).append(e)
    results = []
    for (qtype, n, k), entries in groups.items():
        results += _check_group(mod, d, manifest, qtype, n, k, entries, timer)

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
    ap.add_argument("dir")
    ap.add_argument("--build", action="store_true", help="build DIR here (needs the compiler venv, gguf and nvcc)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.build:
        build(a.dir, a.arch)
        return 0
    return check(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
