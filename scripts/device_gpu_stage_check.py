#!/usr/bin/env python3
"""Check a prebuilt GPU stage on the GPU machine in runtime-only TVM mode, against references made here.

Two modes:

  --build DIR [--arch sm_90]   (here, with the compiler venv) exports a small Qwen3-shaped block the way
      helmc does (torch -> ONNX -> Relax; fp32 activations, fp16 weights as graph inputs in HF
      [out, in] layout), adds two speed probes at Qwen3-8B's MLP shape (decode GEMV 1x4096 @
      4096->12288 and prefill matmul 128x4096 @ 4096->12288), compiles all with
      helmc.compile_gpu_stage for `arch`, and writes DIR/refs.npz: inputs and the torch fp32
      outputs. Regenerate references by running --build again.

  DIR [--out FILE]   (GPU machine, TVM_USE_RUNTIME_LIB=1, PYTHONPATH=<checkout>:.devrt/site) loads
      DIR with helmc.runtime.cuda_runtime (no compiler, no NVRTC), runs every function, prints the
      max difference to the references, and times the probes on random device weights (GB/s of
      weight bytes vs. a device-to-device copy measured in the same run). Exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Small block used for correctness; probe shape is Qwen3-8B's MLP up/gate projection.
DIMS = dict(H=256, HA=4, HKV=2, D=64, I=768, V=1024, EPS=1e-6)
PROBE_K, PROBE_N, PROBE_SEQ = 4096, 12288, 128
FUNCS = ("pre_attn_decode", "pre_attn_prefill", "post_attn_decode", "post_attn_prefill", "head_decode")
TOLERANCE = 1e-4   # max |diff| / max |ref|: fp32 activations and accumulation (5e-7 on the CPU build)


# ----------------------------------------------------------------------------------------------
# Build side (torch, onnx, TVM compiler)
# ----------------------------------------------------------------------------------------------
def _torch_modules():
    import torch
    import torch.nn.functional as F

    H, HA, HKV, D, EPS = DIMS["H"], DIMS["HA"], DIMS["HKV"], DIMS["D"], DIMS["EPS"]

    def rms(t, w):
        var = (t * t).mean(-1, keepdim=True)
        return w.to(torch.float32) * (t * torch.rsqrt(var + EPS))

    class PreAttn(torch.nn.Module):
        def forward(self, x, cos, sin, ln_w, q_w, k_w, v_w, qn_w, kn_w):
            S = x.shape[0]
            h = rms(x, ln_w)
            q = F.linear(h, q_w.to(torch.float32)).reshape(S, HA, D)     # [S, HA*D] -> [S, HA, D]
            k = F.linear(h, k_w.to(torch.float32)).reshape(S, HKV, D)    # [S, HKV*D] -> [S, HKV, D]
            v = F.linear(h, v_w.to(torch.float32)).reshape(S, HKV, D)    # [S, HKV*D] -> [S, HKV, D]
            q, k = rms(q, qn_w), rms(k, kn_w)
            c, s = cos[:, None, :], sin[:, None, :]                       # [S, D] -> [S, 1, D]

            def rot(t):
                return torch.cat([-t[..., D // 2:], t[..., :D // 2]], dim=-1)
            return q * c + rot(q) * s, k * c + rot(k) * s, v

    class PostAttn(torch.nn.Module):
        def forward(self, attn, resid, o_w, ln_w, gate_w, up_w, down_w):
            h = resid + F.linear(attn, o_w.to(torch.float32))
            n = rms(h, ln_w)
            g = F.linear(n, gate_w.to(torch.float32))
            u = F.linear(n, up_w.to(torch.float32))
            return h + F.linear(F.silu(g) * u, down_w.to(torch.float32))

    class Head(torch.nn.Module):
        def forward(self, x, norm_w, lm_w):
            return F.linear(rms(x, norm_w), lm_w.to(torch.float32))

    class Probe(torch.nn.Module):
        def forward(self, x, w):
            return F.linear(x, w.to(torch.float32))

    return PreAttn(), PostAttn(), Head(), Probe()


def _example_args(rng):
    H, HA, HKV, D, I, V = (DIMS[k] for k in ("H", "HA", "HKV", "D", "I", "V"))
    w = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float16)          # noqa: E731
    n = lambda s: (1.0 + 0.1 * rng.standard_normal(s)).astype(np.float16)      # noqa: E731

    def act(S, *s):
        return rng.standard_normal((S, *s)).astype(np.float32)

    def rope(S):
        ang = rng.uniform(0, 6.28, (S, D // 2)).astype(np.float32)
        ang = np.concatenate([ang, ang], -1)                                     # [S, D/2] -> [S, D]
        return np.cos(ang), np.sin(ang)

    pre_w = [n(H), w(HA * D, H), w(HKV * D, H), w(HKV * D, H), n(D), n(D)]
    post_w = [w(H, HA * D), n(H), w(I, H), w(I, H), w(H, I)]
    head_w = [n(H), w(V, H)]
    args = {}
    for S, tag in ((1, "decode"), (7, "prefill")):
        c, s = rope(S)
        args[f"pre_attn_{tag}"] = [act(S, H), c, s] + pre_w
        args[f"post_attn_{tag}"] = [act(S, HA * D), act(S, H)] + post_w
    args["head_decode"] = [act(1, H)] + head_w
    return args


def _export(module, args, dynamic: bool, path: str):
    import torch

    names = [f"in{i}" for i in range(len(args))]
    tensors = tuple(torch.from_numpy(a) for a in args)
    kw = {}
    if dynamic:
        seq = torch.export.Dim("seq", min=1, max=4096)
        kw["dynamic_shapes"] = tuple({0: seq} if a.dtype == np.float32 else None for a in args)
    prog = torch.onnx.export(module, tensors, dynamo=True, input_names=names, **kw)
    prog.save(path)
    with torch.no_grad():
        out = module(*tensors)
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


def build_module(work_dir: str, rng, with_probes: bool = True):
    """The test IRModule (functions FUNCS [+ probe_gemv, probe_prefill]) and the references."""
    import onnx
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    pre, post, head, probe = _torch_modules()
    args = _example_args(rng)
    spec = {"pre_attn_decode": (pre, False), "pre_attn_prefill": (pre, True),
            "post_attn_decode": (post, False), "post_attn_prefill": (post, True),
            "head_decode": (head, False)}
    if with_probes:
        pw = np.zeros((PROBE_N, PROBE_K), np.float16)  # shape only: the device fills its own weights
        args["probe_gemv"] = [np.zeros((1, PROBE_K), np.float32), pw]
        args["probe_prefill"] = [np.zeros((PROBE_SEQ, PROBE_K), np.float32), pw]
        spec["probe_gemv"], spec["probe_prefill"] = (probe, False), (probe, True)
    funcs, refs = {}, {}
    for name, (module, dynamic) in spec.items():
        path = os.path.join(work_dir, f"{name}.onnx")
        outs = _export(module, args[name], dynamic, path)
        imported = from_onnx(onnx.load(path), keep_params_in_input=False)
        funcs[name] = imported["main"].with_attr("global_symbol", name)
        os.unlink(path)
        if not name.startswith("probe_"):
            for i, a in enumerate(args[name]):
                refs[f"{name}/in{i}"] = a
            for i, o in enumerate(outs):
                refs[f"{name}/out{i}"] = o
    return tvm.IRModule(funcs), refs


def build(out_dir: str, arch: str) -> None:
    from helmc.compile_gpu_stage import compile_gpu_stage

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    mod, refs = build_module(out_dir, np.random.default_rng(0))
    t1 = time.time()
    files = compile_gpu_stage(mod, arch, out_dir, name="check_stage")
    t2 = time.time()
    np.savez(os.path.join(out_dir, "refs.npz"), **refs)
    print(f"built {files} for {arch} in {out_dir}: export+import {t1 - t0:.1f}s, compile+nvcc {t2 - t1:.1f}s")


# ----------------------------------------------------------------------------------------------
# Device side (runtime-only TVM, cupy)
# ----------------------------------------------------------------------------------------------
def _time_device(fn, warmup=3, iters=20) -> float:
    """Median seconds per call, with a whole-device synchronize around each call (TVM and CuPy
    both launch on the legacy default stream here)."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        cp.cuda.runtime.deviceSynchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def check(stage_dir: str, out_path: str | None) -> int:
    import cupy as cp
    import tvm.runtime

    from helmc.runtime.cuda_runtime import cupy_to_tvm, load_gpu_executable, tvm_to_cupy

    t0 = time.time()
    vm = load_gpu_executable(os.path.join(stage_dir, "check_stage.so"),
                             os.path.join(stage_dir, "check_stage.cubin.json"))
    report = {"load_s": round(time.time() - t0, 3), "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    refs = np.load(os.path.join(stage_dir, "refs.npz"))
    ok = True
    for name in FUNCS:
        n_in = sum(1 for k in refs.files if k.startswith(f"{name}/in"))
        n_out = sum(1 for k in refs.files if k.startswith(f"{name}/out"))
        ins = [cupy_to_tvm(cp.asarray(refs[f"{name}/in{i}"])) for i in range(n_in)]
        outs = vm[name](*ins)
        outs = [outs] if isinstance(outs, tvm.runtime.Tensor) else list(outs)   # a tuple comes as an Array
        for i in range(n_out):
            got = cp.asnumpy(tvm_to_cupy(outs[i]))
            ref = refs[f"{name}/out{i}"]
            rel = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
            finite = bool(np.isfinite(got).all())
            good = finite and got.shape == ref.shape and rel < TOLERANCE
            ok &= good
            report[f"{name}/out{i}"] = {"max_rel_diff": rel, "finite": finite, "ok": good}
            print(f"{name} out{i} {got.shape}: max|diff|/max|ref| = {rel:.2e} {'ok' if good else 'MISMATCH'}")

    # Speed probes: the reference copy bandwidth, then decode GEMV and prefill matmul at 8B's MLP shape.
    rs = cp.random.RandomState(0)
    w = cupy_to_tvm((rs.standard_normal((PROBE_N, PROBE_K), dtype=cp.float32) * 0.02).astype(cp.float16))
    src = cp.empty(1 << 28, cp.uint8)
    dst = cp.empty_like(src)
    copy_s = _time_device(lambda: dst.__setitem__(Ellipsis, src))
    report["d2d_copy_gbs"] = 2 * src.nbytes / copy_s / 1e9
    w_bytes = PROBE_N * PROBE_K * 2
    for name, seq in (("probe_gemv", 1), ("probe_prefill", PROBE_SEQ)):
        x = cupy_to_tvm(rs.standard_normal((seq, PROBE_K), dtype=cp.float32))
        f = vm[name]
        sec = _time_device(lambda: f(x, w))
        report[name] = {"us": sec * 1e6, "weight_gbs": w_bytes / sec / 1e9,
                        "tflops": 2 * seq * PROBE_N * PROBE_K / sec / 1e12}
        # Correctness of the probe itself against cupy (fp32 math on the same fp16 weights).
        ref = cp.asnumpy(cp.asarray(tvm_to_cupy(x)) @ tvm_to_cupy(w).astype(cp.float32).T)
        got = cp.asnumpy(tvm_to_cupy(f(x, w)))
        rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        report[name]["max_rel_diff"] = rel
        ok &= rel < TOLERANCE
        print(f"{name} [{seq}x{PROBE_K}] @ [{PROBE_K}x{PROBE_N}] fp16 W: {sec * 1e6:.1f} us, "
              f"{w_bytes / sec / 1e9:.0f} GB/s of weights, {report[name]['tflops']:.1f} TFLOP/s, rel diff {rel:.1e}")
    # What cuBLAS does with the same fp16 weight (fp16 activations): the bar for our GEMV.
    wt = tvm_to_cupy(w).T
    for name, seq in (("cublas_gemv", 1), ("cublas_prefill", PROBE_SEQ)):
        xh = rs.standard_normal((seq, PROBE_K), dtype=cp.float32).astype(cp.float16)
        sec = _time_device(lambda: xh @ wt)
        report[name] = {"us": sec * 1e6, "weight_gbs": w_bytes / sec / 1e9,
                        "tflops": 2 * seq * PROBE_N * PROBE_K / sec / 1e12}
        print(f"{name} (cupy fp16): {sec * 1e6:.1f} us, {w_bytes / sec / 1e9:.0f} GB/s, {report[name]['tflops']:.1f} TFLOP/s")
    print(f"device-to-device copy (read+write): {report['d2d_copy_gbs']:.0f} GB/s")
    report["ok"] = bool(ok)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--build", action="store_true", help="build DIR here (needs the compiler venv and nvcc)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    a = ap.parse_args(argv)
    if a.build:
        build(a.dir, a.arch)
        return 0
    return check(a.dir, a.out)


if __name__ == "__main__":
    sys.exit(main())
