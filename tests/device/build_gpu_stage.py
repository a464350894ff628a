"""Build, on the compiler machine (compiler venv, nvcc), the GPU stage that tests/runtime/test_gpu_stage_prebuilt.py
and benchmarks/bench_gpu_stage_probes.py load on the GPU with the runtime-only TVM.

    python -m tests.device.build_gpu_stage .devrt/gpu_stage_check [--arch sm_90]

The GPU stage of a tiny Qwen3 exactly as helmc builds it (helmc.compiler.passes.export_block + import_relax: torch ->
ONNX -> Relax, fp16 activations, fp16 weights as graph inputs in HF [out, in] layout), plus two speed probes at
Qwen3-8B's MLP shape (decode GEMV 1x4096 @ 4096->12288, prefill 128x4096 @ 4096->12288), compiled with
helmc.compiler.passes.compile_gpu_stage for `arch` into DIR/check_stage.so and its cubins; and DIR/refs.npz: every
function's inputs and the outputs of the same torch modules in fp32. Carry DIR to the GPU machine; the test looks in
$HELMC_GPU_STAGE_DIR (default .devrt/gpu_stage_check). Regenerate by running this again.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

# A small Qwen3 block for correctness; the probes have Qwen3-8B's MLP up/gate projection shape.
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "vocab_size": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "dtype": "float16"}
ACT_DTYPE = "float16"         # what helmc's build exports for the GPU stage (pipeline.py)
PROBE_K, PROBE_N, PROBE_SEQ = 4096, 12288, 128
FUNCS = ("pre_attn_decode", "pre_attn_prefill", "post_attn_decode", "post_attn_prefill", "head_decode", "head_prefill")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    build(a.out, a.arch)


if __name__ == "__main__":
    main()
