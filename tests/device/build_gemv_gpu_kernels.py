"""Build, on the compiler machine (compiler venv, gguf, nvcc), the GPU stage's m-row decode GEMVs and their data that
tests/kernels/test_gemv_gpu.py checks and benchmarks/bench_gemv_gpu.py times on the GPU.

    python -m tests.device.build_gemv_gpu_kernels .devrt/gemv_gpu_check [--arch sm_90] [--fused-only | --sweep]

Kernels: schedules/gpu/gemv.py (fp16 and bf16 weights), quant_gemv.py (the other block types) and quant_gemv_int8.py
(q3_k, q4_k, q5_k, q6_k: int8 activations) at Qwen3-8B's projection shapes (and its lm_head for fp16), for m = 1 (a
decode step) and m = 2, 4, 8 (batched decode steps), at the tunings the GPU stage uses; the fp16 m = 1 kernels also at
FLOAT_VARIANTS. One launch, several outputs, fp16 and bf16 (and the int8 GEMV's epilogues), every m: q/k/v (4096,
1024, 1024 rows over k 4096) in one launch, gate/up + SwiGLU (12288 rows), down_proj + residual add (k 12288), with
the separate launches they replace (the GEMVs, then a TIR elementwise kernel of the stage's expression: T.sigmoid,
fp16 ops). One library (helmc's compile_gpu_stage), and per k: x [8, k] fp16 and UNIQUE_ROWS random weight rows per
type (a weight of n rows repeats them; DIR stays small), with x @ their float64 values.
--fused-only: only the one-launch forms and what they are compared with (a smaller DIR); --sweep: the fp16 m = 1
kernels, and the one-launch forms at every SWEEP_VARIANT (rows per warp, unroll; warps fixed, so the bits stay the
default's). The test looks in $HELMC_GEMV_GPU_DIR (default .devrt/gemv_gpu_check).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from tests.device.build_quant_gpu_kernels import QTYPES
from tests.quant_rows import dequantize_reference, random_quant_rows

FLOAT_SHAPES = ((4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096))
QUANT_SHAPES = ((4096, 4096), (4096, 12288))
ROWS = (1, 2, 4, 8)
# other (rows_per_warp, warps, unroll) of the fp16 kernel at m = 1, timed beside the default (bits differ with warps)
FLOAT_VARIANTS = ((1, 4, 4), (2, 4, 2), (4, 4, 4), (2, 8, 2), (1, 8, 2), (4, 2, 4))
UNIQUE_ROWS = 61      # distinct weight rows per type and k (prime: a kernel reading a wrong row still differs)
TOLERANCE = 2e-3     # fp32 sums and one fp16 rounding of y (build_quant_gpu_kernels' reasoning)
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
    for qtype in QTYPES:
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

    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage
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
    files = compile_gpu_stage(tvm.IRModule(funcs), arch, out_dir, name=LIB)
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
        for qtype in QTYPES:
            stored[qtype] = random_quant_rows(qtype, UNIQUE_ROWS, k, rng)
            dense[qtype] = dequantize_reference(qtype, stored[qtype]).astype(np.float64)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--fused-only", action="store_true",
                    help="only the one-launch kernels and what they are compared with (a smaller DIR)")
    ap.add_argument("--sweep", action="store_true", help="only fp16 m = 1 kernels, the one-launch forms at SWEEP_VARIANTS")
    a = ap.parse_args()
    build(a.out, a.arch, a.fused_only, a.sweep)


if __name__ == "__main__":
    main()
