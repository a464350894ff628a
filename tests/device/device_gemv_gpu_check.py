#!/usr/bin/env python3
"""Check the GPU stage's m-row decode GEMVs on the GPU machine: batch invariance, error and speed (issue 19).

Kernels: schedules/gpu/gemv.py (fp16 and bf16 weights), quant_gemv.py (q8_0, q4_0) and quant_gemv_int8.py (q4_k,
q6_k: int8 activations, so their error bound is device_quant_gpu_check's INT8_TOLERANCE) at Qwen3-8B's
projection shapes (and its lm_head for fp16), for m = 1 (a decode step) and m = 2, 4, 8 (batched decode steps).

  --build DIR [--arch sm_90]   (here: compiler venv, gguf, nvcc) one library of every kernel (helmc's
      compile_gpu_stage), and per k: x [8, k] fp16 and UNIQUE_ROWS random weight rows per type (a weight of n
      rows repeats them, as device_quant_gpu_check.py does; DIR stays small).
  DIR [--out FILE]   (GPU machine, runtime-only TVM) per kernel:
      - bitwise: row t of the m-row call equals the 1-row kernel's y on x[t] alone, every t < m, every bit;
      - error: max |y - ref| / max |ref| against float64 (numpy) <= TOLERANCE;
      - speed: median time per call (device_quant_gpu_check's timer: launches queued behind a copy, weights
        rotated over copies larger than L2) and GB/s of weight bytes, so m = 8 against m = 1 shows what the
        extra rows cost at the HBM ceiling.
      Exits 1 if any kernel fails either check.
  One launch, several outputs (issue 16), fp16 and bf16 (and the q4_k / q6_k epilogues), every m: q/k/v (4096,
  1024, 1024 rows over k 4096) in one launch, gate/up + SwiGLU (12288 rows), down_proj + residual add (k 12288):
  each output bit-identical to the separate launches (the GEMVs, then a TIR elementwise kernel of the stage's
  expression: T.sigmoid, fp16 ops), and the time of the one launch against the separate ones queued back to back.
  --build --fused-only: only these (a smaller DIR); --build --sweep: the fp16 m = 1 kernels, and the one-launch
  forms at every SWEEP_VARIANT (rows per warp, unroll; warps fixed, so the bits stay the default's).

  There (device tool, carry [".devrt/site", ".devrt/gemv_gpu_check"]):
    bash scripts/device_run.sh py=tests/device/device_gemv_gpu_check.py,.devrt/gemv_gpu_check,--out,$OUT/gemv.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for p in (_ROOT, _HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import device_quant_gpu_check as dq  # noqa: E402  (its data makers, timer and error measure)

FLOAT_SHAPES = ((4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096))
QUANT_SHAPES = ((4096, 4096), (4096, 12288))
ROWS = (1, 2, 4, 8)
# other (rows_per_warp, warps, unroll) of the fp16 kernel at m = 1, timed beside the default (bits differ with warps)
FLOAT_VARIANTS = ((1, 4, 4), (2, 4, 2), (4, 4, 4), (2, 8, 2), (1, 8, 2), (4, 2, 4))
UNIQUE_ROWS = 61      # distinct weight rows per type and k (prime: a kernel reading a wrong row still differs)
TOLERANCE = 2e-3     # fp32 sums and one fp16 rounding of y (device_quant_gpu_check's reasoning)
LIB = "gemv_kernels"
QKV, GATE, DOWN = (4096, 1024, 1024), 12288, 4096     # Qwen3-8B's rows; k 4096, 4096 and 12288


def kernel_entries() -> list[dict]:
    from helmc.schedules.gpu.gemv import gemv_symbol
    from helmc.schedules.gpu.quant_gemv import gemv_symbol as quant_symbol

    out = []
    for dtype in ("float16", "bfloat16"):
        for n, k in FLOAT_SHAPES if dtype == "float16" else FLOAT_SHAPES[:4]:
            out += [{"type": dtype, "n": n, "k": k, "m": m, "symbol": gemv_symbol(m, n, k, dtype)} for m in ROWS]
            if dtype == "float16":
                out += [{"type": dtype, "n": n, "k": k, "m": 1, "variant": list(t),
                         "symbol": gemv_symbol(1, n, k, dtype, t)} for t in FLOAT_VARIANTS]
    for qtype in dq.QTYPES:
        for n, k in QUANT_SHAPES:
            out += [{"type": qtype, "n": n, "k": k, "m": m, "symbol": quant_symbol(qtype, n, k, m=m)} for m in ROWS]
    return out


# --sweep: (rows_per_warp, warps, unroll) of the fp16 one-launch forms at m = 1 (warps 4: the bits stay the
# default's, so a faster tuning changes no token)
SWEEP_VARIANTS = ((1, 4, 4), (2, 4, 4), (4, 4, 4), (1, 4, 8), (2, 4, 8), (4, 4, 2), (8, 4, 2), (2, 4, 2))


def sweep_entries() -> list[dict]:
    from helmc.schedules.gpu.gemv import gemv_symbol

    out = []
    for kind, ns, k in (("qkv", QKV, 4096), ("swiglu", (GATE,), 4096), ("residual", (DOWN,), 12288)):
        epilogue = None if kind == "qkv" else kind
        for t in SWEEP_VARIANTS:
            out.append({"kind": kind, "type": "float16", "m": 1, "n": list(ns), "k": k, "tuning": list(t),
                        "symbol": gemv_symbol(1, ns if epilogue is None else ns[0], k, "float16", t, epilogue),
                        "parts": [gemv_symbol(1, n, k, "float16") for n in ns],
                        "ref": None if kind == "qkv" else f"ref_{kind}_{ns[0]}"})
    return out


def fused_entries() -> list[dict]:
    from helmc.compiler.passes.lower_quantized_gpu import GEMV_INT8_EPILOGUE_TUNING, GEMV_INT8_TUNING
    from helmc.schedules.gpu.gemv import gemv_symbol
    from helmc.schedules.gpu.quant_gemv_int8 import INT8_TYPES, gemv_int8_symbol

    out = []
    for qtype in INT8_TYPES:     # the int8 GEMV's epilogues, at the tunings the GPU stage uses
        for m in ROWS:
            for kind, n, k in (("swiglu", GATE, 4096), ("residual", DOWN, 12288)):
                out.append({"kind": kind, "type": qtype, "m": m, "n": [n], "k": k,
                            "tuning": list(GEMV_INT8_EPILOGUE_TUNING[(qtype, kind)]),
                            "symbol": gemv_int8_symbol(qtype, n, k, *GEMV_INT8_EPILOGUE_TUNING[(qtype, kind)], m=m,
                                                       epilogue=kind),
                            "parts": [gemv_int8_symbol(qtype, n, k, *GEMV_INT8_TUNING[qtype], m=m)],
                            "ref": f"ref_{kind}_{m * n}"})
    for dtype in ("float16", "bfloat16"):
        for m in ROWS:
            for kind, ns, k in (("qkv", QKV, 4096), ("swiglu", (GATE,), 4096), ("residual", (DOWN,), 12288)):
                epilogue = None if kind == "qkv" else kind
                out.append({"kind": kind, "type": dtype, "m": m, "n": list(ns), "k": k,
                            "symbol": gemv_symbol(m, ns if epilogue is None else ns[0], k, dtype, epilogue=epilogue),
                            "parts": [gemv_symbol(m, n, k, dtype) for n in ns],
                            "ref": None if kind == "qkv" else f"ref_{kind}_{m * ns[0]}"})
    return out


def _elementwise(kind: str, size: int):
    """y = a * sigmoid(a) * b (swiglu) or a + b (residual) over fp16 [size], as the stage's elementwise kernels
    compute it (fp16 ops; T.sigmoid lowers to the same CUDA as the legalized R.sigmoid)."""
    from tvm.script import tirx as T

    threads = 256

    @T.prim_func
    def f(a: T.Buffer((size,), "float16"), b: T.Buffer((size,), "float16"), y: T.Buffer((size,), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(-(-size // threads), thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                if bx * threads + tx < size:
                    if kind == "swiglu":
                        y[bx * threads + tx] = a[bx * threads + tx] * T.sigmoid(a[bx * threads + tx]) * b[
                            bx * threads + tx]
                    else:
                        y[bx * threads + tx] = a[bx * threads + tx] + b[bx * threads + tx]

    return f


def build(out_dir: str, arch: str, fused_only: bool = False, sweep: bool = False) -> None:
    import tvm

    from helmc.compiler.passes.lower_quantized_gpu import GEMV_INT8_TUNING, GEMV_TUNING
    from helmc.schedules.gpu.gemv import make_gpu_gemv
    from helmc.schedules.gpu.quant_gemv import gemv_symbol as quant_symbol, make_gpu_gemv_quant
    from helmc.schedules.gpu.quant_gemv_int8 import INT8_TYPES, gemv_int8_symbol, make_gpu_gemv_int8

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    entries = [] if fused_only else kernel_entries()
    if sweep:      # the fp16 m = 1 GEMVs at every FLOAT_VARIANT, and the one-launch forms at every SWEEP_VARIANT
        entries = [e for e in kernel_entries() if e["type"] == "float16" and e["m"] == 1]
    funcs = {}
    for e in entries:
        if e["type"] in ("float16", "bfloat16"):
            funcs[e["symbol"]] = make_gpu_gemv(e["m"], e["n"], e["k"], e["type"],
                                               tuple(e["variant"]) if e.get("variant") else None)
        elif e["type"] in INT8_TYPES:     # the kernel and tuning the GPU stage uses (lower_quantized_gpu)
            e["tuning"] = list(GEMV_INT8_TUNING[e["type"]])
            e["symbol"] = gemv_int8_symbol(e["type"], e["n"], e["k"], *e["tuning"], m=e["m"])
            funcs[e["symbol"]] = make_gpu_gemv_int8(e["type"], e["n"], e["k"], *e["tuning"], m=e["m"])
        else:      # the tuning the GPU stage uses (lower_quantized_gpu), under the default symbol of the check
            f = make_gpu_gemv_quant(e["type"], e["n"], e["k"], *GEMV_TUNING[e["type"]], m=e["m"])
            e["tuning"] = list(GEMV_TUNING[e["type"]])
            e["symbol"] = quant_symbol(e["type"], e["n"], e["k"], *GEMV_TUNING[e["type"]], m=e["m"])
            funcs[e["symbol"]] = f
    fused = sweep_entries() if sweep else fused_entries()
    for e in fused:
        epilogue = None if e["kind"] == "qkv" else e["kind"]
        if e["type"] in INT8_TYPES:
            funcs[e["symbol"]] = make_gpu_gemv_int8(e["type"], e["n"][0], e["k"], *e["tuning"], m=e["m"],
                                                    epilogue=epilogue)
            funcs[e["parts"][0]] = make_gpu_gemv_int8(e["type"], e["n"][0], e["k"], *GEMV_INT8_TUNING[e["type"]],
                                                      m=e["m"])
            funcs[e["ref"]] = _elementwise(e["kind"], e["m"] * e["n"][0]).with_attr("global_symbol", e["ref"])
            continue
        funcs[e["symbol"]] = make_gpu_gemv(e["m"], tuple(e["n"]) if epilogue is None else e["n"][0], e["k"], e["type"],
                                           tuple(e["tuning"]) if e.get("tuning") else None, epilogue=epilogue)
        for n, part in zip(e["n"], e["parts"]):        # the separate launches (kernel_entries' too, unless fused_only)
            funcs[part] = make_gpu_gemv(e["m"], n, e["k"], e["type"])
        if e["ref"]:
            funcs[e["ref"]] = _elementwise(e["kind"], e["m"] * e["n"][0]).with_attr("global_symbol", e["ref"])
    files = dq._compile_gpu_stage()(tvm.IRModule(funcs), arch, out_dir, name=LIB)
    t1 = time.time()
    rng = np.random.default_rng(0)
    for k in sorted({e["k"] for e in entries + fused}):
        x = rng.standard_normal((max(ROWS), k)).astype(np.float16)
        np.save(os.path.join(out_dir, f"x_k{k}.npy"), x)
        w = (0.05 * rng.standard_normal((UNIQUE_ROWS, k))).astype(np.float32)
        bits = w.view(np.uint32)                                          # bf16: round to nearest even
        stored = {"float16": w.astype(np.float16),
                  "bfloat16": ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)}
        dense = {"float16": stored["float16"].astype(np.float64),
                 "bfloat16": (stored["bfloat16"].astype(np.uint32) << 16).view(np.float32).astype(np.float64)}
        for qtype in dq.QTYPES:
            stored[qtype] = dq.random_quant_rows(qtype, UNIQUE_ROWS, k, rng)
            dense[qtype] = dq.dequantize_reference(qtype, stored[qtype]).astype(np.float64)
        for t in stored:      # the weights as stored, and x @ their float64 values: [8, UNIQUE_ROWS]
            np.save(os.path.join(out_dir, f"w_{t}_k{k}.npy"), stored[t])
            np.save(os.path.join(out_dir, f"ref_{t}_k{k}.npy"), x.astype(np.float64) @ dense[t].T)
    os.remove(os.path.join(out_dir, f"{LIB}.cu"))           # the source, for reading only: less to carry
    manifest = {"arch": arch, "library": f"{LIB}.so", "cubin_index": f"{LIB}.cubins.json", "unique_rows": UNIQUE_ROWS,
                "tolerance": TOLERANCE, "kernels": entries,
                "fused": fused}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(os.path.join(out_dir, p)) for p in os.listdir(out_dir))
    print(f"built {len(funcs)} kernels {files} for {arch}: compile+nvcc {t1 - t0:.1f}s, {size / 2**20:.1f} MiB")


def _check_group(mod, d: str, dtype: str, n: int, k: int, entries: list[dict], timer) -> list[dict]:
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm

    pick = np.arange(n) % UNIQUE_ROWS
    w_host = np.ascontiguousarray(np.load(os.path.join(d, f"w_{dtype}_k{k}.npy"))[pick])   # [n, k] or [n, row bytes]
    x_host = np.load(os.path.join(d, f"x_k{k}.npy"))                                         # [8, k] fp16
    ref = np.load(os.path.join(d, f"ref_{dtype}_k{k}.npy"))[:, pick]                         # [8, n] float64
    copies = max(2, -(-dq.L2_DEFEAT_BYTES // w_host.nbytes))
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
        err = dq._rel(y, ref[:m])
        sec, queued = timer(lambda i: f(x_tvm, w_tvm[i % copies], y_tvm))
        r = dict(e, bitwise=bitwise, max_rel_err=err, us=sec * 1e6, weight_gbs=w_host.nbytes / sec / 1e9,
                 queued=queued, ok=bool(bitwise and err <= (dq.INT8_TOLERANCE if e["symbol"].startswith(
                     "helmc_gpu_gemv8_") else TOLERANCE)))
        print(f"{dtype:8s} {n}x{k} m={m}: rows {'bit-identical to 1-row' if bitwise else 'DIFFER from 1-row'}, "
              f"max rel err {err:.2e}, {sec * 1e6:.1f} us, {r['weight_gbs']:.0f} GB/s of weights"
              + ("" if queued else " (launch-bound)"), flush=True)
        results.append(r)
    del w_dev, w_tvm
    cp.get_default_memory_pool().free_all_blocks()
    return results


def _check_fused(mod, d: str, entries: list[dict], timer) -> list[dict]:
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
        copies = max(2, -(-dq.L2_DEFEAT_BYTES // sum(w.nbytes for w in host)))   # weight sets rotated per call
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


def check(d: str, out_path: str | None) -> int:
    import cupy as cp

    from helmc.runtime.cuda_runtime import load_gpu_executable

    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    mod = load_gpu_executable(os.path.join(d, manifest["library"]), os.path.join(d, manifest["cubin_index"]))
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    timer = dq._Timer()
    groups: dict[tuple, list[dict]] = {}
    for e in manifest["kernels"]:
        groups.setdefault((e["type"], e["n"], e["k"]), []).append(e)
    results = []
    for (dtype, n, k), entries in groups.items():
        results += _check_group(mod, d, dtype, n, k, entries, timer)
    fused = _check_fused(mod, d, manifest.get("fused", []), timer)
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
    ap.add_argument("dir")
    ap.add_argument("--build", action="store_true", help="build DIR here (needs the compiler venv, gguf and nvcc)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--fused-only", action="store_true",
                    help="with --build: only the one-launch kernels and what they are compared with (a smaller DIR)")
    ap.add_argument("--sweep", action="store_true",
                    help="with --build: only fp16 m = 1 kernels, the one-launch forms at SWEEP_VARIANTS")
    a = ap.parse_args(argv)
    return build(a.dir, a.arch, a.fused_only, a.sweep) or 0 if a.build else check(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
