#!/usr/bin/env python3
"""Check a prebuilt GPU stage on the GPU machine in runtime-only TVM mode, against references made here.

Two modes:

  --build DIR [--arch sm_90]   (here, with the compiler venv) builds the GPU stage of a tiny Qwen3
      exactly as helmc does (helmc.compiler.passes.export_block + import_relax: torch -> ONNX -> Relax, fp16
      activations, fp16 weights as graph inputs in HF [out, in] layout), adds two speed probes at
      Qwen3-8B's MLP shape (decode GEMV 1x4096 @ 4096->12288, prefill 128x4096 @ 4096->12288),
      compiles everything with helmc.compiler.passes.compile_gpu_stage for `arch`, and writes DIR/refs.npz: the
      inputs and the outputs of the same torch modules in fp32. Regenerate by running --build again.

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

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# A small Qwen3 block for correctness; the probes have Qwen3-8B's MLP up/gate projection shape.
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "dtype": "float16"}
ACT_DTYPE = "float16"         # what helmc's build exports for the GPU stage (pipeline.py)
PROBE_K, PROBE_N, PROBE_SEQ = 4096, 12288, 128
FUNCS = ("pre_attn_decode", "pre_attn_prefill", "post_attn_decode", "post_attn_prefill", "head_decode", "head_prefill")
TOLERANCE = 1e-2   # max |diff| / max |ref| against torch in fp32: the stage keeps activations in fp16


# ----------------------------------------------------------------------------------------------
# Build side (torch, onnx, TVM compiler)
# ----------------------------------------------------------------------------------------------
def _example_args(spec, rng):
    """Inputs per function, in helmc.compiler.passes.export_block's argument order; weights fp16, x in ACT_DTYPE."""

    H, D = spec.hidden_size, spec.head_dim
    shapes = dict(spec.block_weight_shapes())
    shapes.update({"model.norm.weight": (H,), "lm_head.weight": (spec.vocab_size, H)})

    def weight(name):
        if name.endswith("norm.weight"):
            return (1.0 + 0.1 * rng.standard_normal(shapes[name])).astype(np.float16)
        return (0.05 * rng.standard_normal(shapes[name])).astype(np.float16)

    def act(S, n):
        return rng.standard_normal((S, n)).astype(ACT_DTYPE)

    def rope(S):
        ang = rng.uniform(0, 6.28, (S, D // 2)).astype(np.float32)
        ang = np.concatenate([ang, ang], -1)                                     # [S, D/2] -> [S, D]
        return np.cos(ang), np.sin(ang)

    pre_w = [weight(n) for n in spec.pre_attn_weight_names()]
    post_w = [weight(n) for n in spec.post_attn_weight_names()]
    head_w = [weight(n) for n in spec.head_weight_names()]
    args = {}
    for S, tag in ((1, "decode"), (7, "prefill")):
        c, s = rope(S)
        args[f"pre_attn_{tag}"] = [act(S, H), c, s] + pre_w
        args[f"post_attn_{tag}"] = [act(S, H), act(S, spec.q_dim)] + post_w
        args[f"head_{tag}"] = [act(S, H)] + head_w
    return args


def _fp32_references(spec, args):
    """The same functions in torch with fp32 activations (helmc.compiler.passes.export_block's own modules)."""
    import torch

    from helmc.compiler.passes.export_block import _modules

    mods = dict(zip(("pre_attn", "post_attn", "head"), _modules(spec, "float32")))
    refs = {}
    with torch.no_grad():
        for name, a in args.items():
            ins = [torch.from_numpy(v.astype(np.float32) if i < 2 and v.dtype == np.float16 else v)
                   for i, v in enumerate(a)]
            out = mods[name.rsplit("_", 1)[0]](*ins)
            refs[name] = [o.float().numpy() for o in (out if isinstance(out, tuple) else (out,))]
    return refs


def _probe_functions(work_dir: str):
    """probe_gemv [1,K] @ [N,K]^T and probe_prefill [seq,K] @ [N,K]^T, fp16 like the stage's linears."""
    import onnx
    import torch
    import torch.nn.functional as F
    from tvm.relax.frontend.onnx import from_onnx

    class Probe(torch.nn.Module):
        def forward(self, x, w):
            return F.linear(x, w)

    w = torch.zeros(PROBE_N, PROBE_K, dtype=torch.float16)
    funcs = {}
    for name, seq, dyn in (("probe_gemv", 1, None), ("probe_prefill", PROBE_SEQ, torch.export.Dim("seq", min=1, max=4096))):
        x = torch.zeros(seq, PROBE_K, dtype=torch.float16)
        kw = {"dynamic_shapes": ({0: dyn}, None)} if dyn is not None else {}
        path = os.path.join(work_dir, f"{name}.onnx")
        torch.onnx.export(Probe(), (x, w), dynamo=True, input_names=["x", "w"], **kw).save(path)
        funcs[name] = from_onnx(onnx.load(path), keep_params_in_input=False)["main"].with_attr("global_symbol", name)
        os.unlink(path)
    return funcs


def build_module(work_dir: str, rng, with_probes: bool = True):
    """The GPU stage of a tiny Qwen3 exactly as helmc builds it (export_block + import_relax, fp16
    activations), plus the probes; and the fp32 torch references."""
    import tvm

    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config(TINY_QWEN3)
    mod = import_functions(export_functions(spec, act_dtype=ACT_DTYPE))
    funcs = {gv.name_hint: mod[gv] for gv in mod.get_global_vars()}
    if with_probes:
        funcs.update(_probe_functions(work_dir))
    args = _example_args(spec, rng)
    outs = _fp32_references(spec, args)
    refs = {}
    for name in FUNCS:
        refs.update({f"{name}/in{i}": a for i, a in enumerate(args[name])})
        refs.update({f"{name}/out{i}": o for i, o in enumerate(outs[name])})
    return tvm.IRModule(funcs), refs


def build(out_dir: str, arch: str) -> None:
    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage

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
def _time_device(fn, inner=10, repeats=7) -> float:
    """Median over `repeats` of the mean seconds per call over `inner` back-to-back calls, with a
    whole-device synchronize around each group (TVM and CuPy both use the legacy default stream)."""
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


def check(stage_dir: str, out_path: str | None) -> int:
    import cupy as cp
    import tvm.runtime

    from helmc.runtime.cuda_runtime import cupy_to_tvm, load_gpu_vm, tvm_to_cupy

    t0 = time.time()
    vm = load_gpu_vm(os.path.join(stage_dir, "check_stage.so"),
                     os.path.join(stage_dir, "check_stage.cubins.json"))
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
        x = cupy_to_tvm(rs.standard_normal((seq, PROBE_K), dtype=cp.float32).astype(cp.float16))
        f = vm[name]
        sec = _time_device(lambda: f(x, w))
        report[name] = {"us": sec * 1e6, "weight_gbs": w_bytes / sec / 1e9,
                        "tflops": 2 * seq * PROBE_N * PROBE_K / sec / 1e12}
        # Correctness of the probe itself against cupy (fp32 math on the same fp16 inputs).
        ref = cp.asnumpy(tvm_to_cupy(x).astype(cp.float32) @ tvm_to_cupy(w).astype(cp.float32).T)
        got = cp.asnumpy(tvm_to_cupy(f(x, w))).astype(np.float32)
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

    # Weight upload path: a 1 GiB host array (pageable, like an mmapped safetensors file) through
    # PinnedUploader's 64 MiB double-buffered pinned staging; bf16 as raw uint16 bits.
    from helmc.runtime.cuda_runtime import PinnedUploader

    block = np.random.default_rng(1).integers(0, 1 << 16, size=(1 << 20,), dtype=np.uint16)
    host = np.tile(block, 512)                                                   # [2^29] uint16: 1 GiB
    up = PinnedUploader()
    t = time.perf_counter()
    t_bf16 = up.upload(host.reshape(1 << 15, 1 << 14), dtype="bfloat16")
    up.synchronize()
    sec = time.perf_counter() - t
    back = tvm_to_cupy(t_bf16).reshape(-1)
    same = bool(cp.array_equal(back[::1000003], cp.asarray(host[::1000003]))) and int(back[-1]) == int(host[-1])
    report["upload"] = {"bytes": host.nbytes, "s": sec, "gbs": host.nbytes / sec / 1e9, "bit_exact": same,
                        "tvm_dtype": str(t_bf16.dtype)}
    ok &= same and str(t_bf16.dtype) == "bfloat16"
    print(f"PinnedUploader 1 GiB host -> device: {host.nbytes / sec / 1e9:.1f} GB/s, bit-exact {same}, "
          f"tvm dtype {t_bf16.dtype}")
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
