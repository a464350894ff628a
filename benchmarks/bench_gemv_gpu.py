"""The GPU stage's m-row decode GEMVs timed on the GPU machine at Qwen3-8B's projection shapes, m = 1, 2, 4, 8, with
their batch invariance and error; and the one-launch forms (q/k/v, gate/up + SwiGLU, down + residual) against the
separate launches they replace.

    python -m benchmarks.bench_gemv_gpu DIR [--out FILE.json]

DIR from `python -m tests.device.build_gemv_gpu_kernels DIR` (compiler machine); runs with the runtime-only TVM. Per
kernel: whether row t of the m-row call equals the 1-row kernel's y on x[t] alone (every bit), max |y - ref| /
max |ref| against float64, the median time per call (bench_quant_gemv_gpu's timer: launches queued behind a copy,
weights rotated over copies larger than L2) and GB/s of weight bytes, so m = 8 against m = 1 shows what the extra
rows cost at the HBM ceiling; per one-launch form, whether each output is bit-identical to the separate launches and
both times. Exits 1 if any kernel fails a check; the pass/fail check is pytest's:
`pytest -m gpu tests/kernels/test_gemv_gpu.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from benchmarks.bench_quant_gemv_gpu import L2_DEFEAT_BYTES, Timer
from tests.device.build_gemv_gpu_kernels import ROWS, TOLERANCE, UNIQUE_ROWS
from tests.device.build_quant_gpu_kernels import INT8_TOLERANCE
from tests.quant_rows import rel_err


def run_group(mod, d: str, dtype: str, n: int, k: int, entries: list[dict], timer) -> list[dict]:
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm

    pick = np.arange(n) % UNIQUE_ROWS
    w_host = np.ascontiguousarray(np.load(os.path.join(d, f"w_{dtype}_k{k}.npy"))[pick])   # [n, k] or [n, row bytes]
    x_host = np.load(os.path.join(d, f"x_k{k}.npy"))                                         # [8, k] fp16
    ref = np.load(os.path.join(d, f"ref_{dtype}_k{k}.npy"))[:, pick]                         # [8, n] float64
    copies = max(2, -(-L2_DEFEAT_BYTES // w_host.nbytes))
    w_dev = [cp.asarray(w_host)]
    if dtype == "bfloat16":
        w_dev[0] = w_dev[0].view(cp.uint16)
    for _ in range(copies - 1):
        w_dev.append(w_dev[0].copy())
    as_tvm = (lambda a: cupy_to_tvm(a, "bfloat16")) if dtype == "bfloat16" else cupy_to_tvm
    w_tvm = [as_tvm(w) for w in w_dev]
    one = mod[next(e["symbol"] for e in entries if e["m"] == 1 and not e.get("variant"))]
    singles = []
    for t in range(max(ROWS)):                       # each row of x alone through the 1-row kernel
        y = cp.zeros((1, n), cp.float16)
        one(cupy_to_tvm(cp.asarray(x_host[t:t + 1])), w_tvm[0], cupy_to_tvm(y))
        singles.append(cp.asnumpy(y)[0])
    results = []
    for e in entries:
        m, f = e["m"], mod[e["symbol"]]
        x_tvm = cupy_to_tvm(cp.asarray(np.ascontiguousarray(x_host[:m])))
        y_dev = cp.zeros((m, n), cp.float16)
        y_tvm = cupy_to_tvm(y_dev)
        f(x_tvm, w_tvm[0], y_tvm)
        y = cp.asnumpy(y_dev)
        bitwise = e.get("variant") is not None or all(
            np.array_equal(y[t].view(np.uint16), singles[t].view(np.uint16)) for t in range(m))
        err = rel_err(y, ref[:m])
        sec, queued = timer(lambda i: f(x_tvm, w_tvm[i % copies], y_tvm))
        r = dict(e, bitwise=bitwise, max_rel_err=err, us=sec * 1e6, weight_gbs=w_host.nbytes / sec / 1e9,
                 queued=queued, ok=bool(bitwise and err <= (INT8_TOLERANCE if e["symbol"].startswith(
                     "helmc_gpu_gemv8_") else TOLERANCE)))
        print(f"{dtype:8s} {n}x{k} m={m}: rows {'bit-identical to 1-row' if bitwise else 'DIFFER from 1-row'}, "
              f"max rel err {err:.2e}, {sec * 1e6:.1f} us, {r['weight_gbs']:.0f} GB/s of weights"
              + ("" if queued else " (launch-bound)"), flush=True)
        results.append(r)
    del w_dev, w_tvm
    cp.get_default_memory_pool().free_all_blocks()
    return results


def run_fused(mod, d: str, entries: list[dict], timer) -> list[dict]:
    """Each one-launch kernel against its separate launches: bits of every output, and time."""
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm

    results = []
    rng = np.random.default_rng(1)
    for e in entries:
        dtype, m, k, kind = e["type"], e["m"], e["k"], e["kind"]
        rows = np.load(os.path.join(d, f"w_{dtype}_k{k}.npy"))
        shapes = e["n"] * 2 if kind == "swiglu" else e["n"]                    # gate and up: two weights
        host = [np.ascontiguousarray(rows[(np.arange(n) + 7 * i) % UNIQUE_ROWS]) for i, n in enumerate(shapes)]
        copies = max(2, -(-L2_DEFEAT_BYTES // sum(w.nbytes for w in host)))   # weight sets rotated per call
        as_tvm = (lambda a: cupy_to_tvm(a, "bfloat16")) if dtype == "bfloat16" else cupy_to_tvm
        w_dev = [[cp.asarray(w).view(cp.uint16) if dtype == "bfloat16" else cp.asarray(w) for w in host]]
        w_dev += [[w.copy() for w in w_dev[0]] for _ in range(copies - 1)]
        wt = [[as_tvm(w) for w in ws] for ws in w_dev]
        x = cupy_to_tvm(cp.asarray(np.ascontiguousarray(np.load(os.path.join(d, f"x_k{k}.npy"))[:m])))
        fused, parts = mod[e["symbol"]], [mod[s] for s in e["parts"]]
        ref = mod[e["ref"]] if e["ref"] else None
        new = lambda n: cp.full((m, n), np.nan, cp.float16)                       # noqa: E731
        tv = lambda arrays: [cupy_to_tvm(a.reshape(-1)) for a in arrays]         # noqa: E731  [m, n] -> [m * n]
        if kind == "qkv":
            got, want = [new(n) for n in shapes], [new(n) for n in shapes]
            got_t, want_t = [cupy_to_tvm(a) for a in got], [cupy_to_tvm(a) for a in want]
            one = lambda i: fused(x, *wt[i % copies], *got_t)                     # noqa: E731
            separate = lambda i: [parts[j](x, wt[i % copies][j], want_t[j]) for j in range(3)]  # noqa: E731
        else:
            n = shapes[0]
            got, want, mid = [new(n)], [new(n)], [new(n), new(n)]
            r = cp.asarray(rng.standard_normal((m, n)).astype(np.float16))          # the residual stream
            got_t, mid_t = [cupy_to_tvm(got[0]), cupy_to_tvm(r)], [cupy_to_tvm(a) for a in mid]
            want_f, mid0_f, mid1_f, r_f = tv([want[0], mid[0], mid[1], r])       # the elementwise kernels' views
            if kind == "swiglu":
                one = lambda i: fused(x, *wt[i % copies], got_t[0])               # noqa: E731

                def separate(i):
                    for j in range(2):
                        parts[0](x, wt[i % copies][j], mid_t[j])
                    ref(mid0_f, mid1_f, want_f)
            else:
                one = lambda i: fused(x, wt[i % copies][0], got_t[1], got_t[0])   # noqa: E731

                def separate(i):
                    parts[0](x, wt[i % copies][0], mid_t[0])
                    ref(r_f, mid0_f, want_f)
        one(0)
        separate(0)
        cp.cuda.runtime.deviceSynchronize()
        bitwise = all(bool(cp.isfinite(a).all()) and bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
                      for a, b in zip(got, want))
        (t_one, q1), (t_sep, q2) = timer(one), timer(separate)
        result = dict(e, bitwise=bitwise, us=t_one * 1e6, separate_us=t_sep * 1e6, queued=q1 and q2, ok=bitwise)
        print(f"one launch {kind:8s} {dtype:8s} m={m}{' ' + str(e['tuning']) if e.get('tuning') else ''}: "
              f"{'bit-identical to' if bitwise else 'DIFFERS from'} the "
              f"separate launches; {t_one * 1e6:.1f} us against {t_sep * 1e6:.1f} us", flush=True)
        results.append(result)
        del w_dev, wt
        cp.get_default_memory_pool().free_all_blocks()
    return results


def measure(d: str, out_path: str | None) -> int:
    import cupy as cp

    from helmc.runtime.cuda_runtime import load_gpu_executable

    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    mod = load_gpu_executable(os.path.join(d, manifest["library"]), os.path.join(d, manifest["cubin_index"]))
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    timer = Timer()
    groups: dict[tuple, list[dict]] = {}
    for e in manifest["kernels"]:
        groups.setdefault((e["type"], e["n"], e["k"]), []).append(e)
    results = []
    for (dtype, n, k), entries in groups.items():
        results += run_group(mod, d, dtype, n, k, entries, timer)
    fused = run_fused(mod, d, manifest.get("fused", []), timer)
    ok = all(r["ok"] for r in results + fused)
    print(f"\n{'type':8s} {'n x k':>12s} | " + " | ".join(f"m={m}: us  GB/s" for m in ROWS) + "   on " + device)
    for key, entries in groups.items():
        mine = {r["m"]: r for r in results if (r["type"], r["n"], r["k"]) == key and not r.get("variant")}
        variants = sorted((r for r in results if (r["type"], r["n"], r["k"]) == key and r.get("variant")),
                          key=lambda r: r["us"])
        flags = ("" if all(r["ok"] for r in mine.values()) else "  FAIL") + ("  best m=1 tuning r{}w{}u{}: ".format(
            *variants[0]["variant"]) + f"{variants[0]['us']:.1f} us" if variants else "")
        print(f"{key[0]:8s} {key[1]:>6d}x{key[2]:<5d} | " + " | ".join(        # --sweep builds m = 1 only
            f"{mine[m]['us']:7.1f} {mine[m]['weight_gbs']:5.0f}" if m in mine else f"{'-':>13s}" for m in ROWS) + flags)
    if fused:
        saved = sum(r["separate_us"] - r["us"] for r in fused
                    if r["m"] == 1 and r["type"] == "float16" and not r.get("tuning"))
        print(f"one launch: {sum(r['bitwise'] for r in fused)} of {len(fused)} bit-identical to their separate "
              f"launches; {saved:.1f} us saved per fp16 block at m=1 (queued launches, no graph)")
    print(f"bitwise: every row of every m-row call equals the 1-row call on it; tolerance {TOLERANCE:g}; "
          f"{'OK' if ok else 'FAILED'}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": device, "ok": ok, "results": results, "fused": fused}, f, indent=1)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the kernels from tests.device.build_gemv_gpu_kernels")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    return measure(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
