"""gpt-oss's GPU stage compiled for sm_90 on this machine (no GPU needed): a tiny gpt-oss built with every block and
the head on the GPU through the real build (export in float16, import, quantize_functions, CUDA codegen to cubin,
the bundle written), and its MXFP4 experts through the GPU's MXFP4 GEMV and dequantizer.

What it checks: post_moe takes o_proj's and the router's biases after their weights (the weights binding binds
them: ModelSpec.post_attn_weight_names), the expert function its three biases after its three weights; the clamped
SwiGLU lowers to one CUDA kernel (where x3, sigmoid); fp16 experts get no two-launch expert kernels (they read GGUF
blocks); MXFP4 expert weights get the MXFP4 GEMV (decode) and dequantizer (prefill) kernels and the biased two-launch
expert kernels (one row and m rows: schedules/gpu/moe_experts_biased.py) with the model's clamp and alpha.
Nothing runs the bundle here (tests/runtime/test_gpt_oss_gpu.py runs bundles on a GPU)."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from helmc.model.spec import ModelSpec

pytest.importorskip("tvm.relax")


def h200():
    from helmc.hardware.profile import PRESET_DIR, load_hardware
    return load_hardware(os.path.join(PRESET_DIR, "h200-profiled.json"))


def gpu_cuda_source(d: str) -> str:
    with open(os.path.join(d, "gpu_stage.cu")) as f:
        return f.read()


def test_a_tiny_gpt_oss_gpu_stage_builds_for_sm_90(tmp_path, cache_dir):
    from helmc.compiler.pipeline import build, gpu_moe_kernels, search_plan
    from helmc.compiler.read_model import read_model
    from helmc.testing import make_tiny_model, write_gpt_oss_gguf
    hf, hw = str(tmp_path / "hf"), h200()
    make_tiny_model(hf, "gpt_oss", num_layers=2, dtype="float32", hidden_size=128, intermediate_size=64)
    model = str(tmp_path / "gpt-oss.gguf")          # Q8_0 attention and head as llama.cpp's files; float experts
    write_gpt_oss_gguf(hf, model, linears="q8_0", embed="f16")
    spec = read_model(model).spec
    assert spec.o_bias and spec.qkv_bias and spec.moe.router_bias and spec.moe.biased_experts
    assert gpu_moe_kernels(spec) == {}                               # fp16 experts: no GGUF blocks to read
    assert spec.post_attn_weight_names(0) == ("self_attn.o_proj.weight", "self_attn.o_proj.bias",
                                              "post_attention_layernorm.weight", "mlp.router.weight",
                                              "mlp.router.bias")
    plan = search_plan(spec, hw, 128, 32, hybrid=False).replace(
        cpu_units=0, candidates=(), groups=(), hybrid_candidates=(), prefill_on_gpu=False, prefill_staging_bytes=0,
        prefill_chunk_tokens=0, staging_ring_bytes=0, t_copy_ms=0.0)
    assert plan.placement.gpu_layers == range(2) or tuple(plan.placement.gpu_layers) == (0, 1)
    bundle = str(tmp_path / "bundle")
    r = build(model, hw, bundle, plan=plan, cache_dir=cache_dir, quiet=True, use_cache=False)
    files = set(os.listdir(bundle))
    assert {"gpu_stage.so", "gpu_stage.sm_90.cubin", "paged_attention.cubin", "cpu_stage.so"} <= files, files
    assert r.plan.placement.head_on_gpu and r.plan.placement.cpu_units == 0
    cu = gpu_cuda_source(bundle)
    # the clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g): its where's and sigmoid fused into one kernel
    assert re.search(r"fused_\w*where\w*sigmoid\w*_kernel", cu), "no fused clamped-SwiGLU kernel"
    assert "0x1.b3cp+0f" in cu                                       # alpha 1.702 in fp16
    with open(os.path.join(bundle, "manifest.json")) as f:
        assert json.load(f)["cuda_arch"] == "sm_90"


def test_gpt_oss_functions_take_their_biases_and_mxfp4_experts_compile_for_sm_90(tmp_path):
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.pipeline import compile_gpu
    from helmc.compiler.read_model import read_model
    from helmc.runtime.function_names import gpu_moe_names, gpu_moe_rows_names
    from helmc.testing import make_tiny_model
    model = str(tmp_path / "model")
    make_tiny_model(model, "gpt_oss", num_layers=2, dtype="float16", hidden_size=128, intermediate_size=64)
    spec = read_model(model).spec
    # llama.cpp's gpt-oss mix: MXFP4 experts, Q8_0 attention (whole 32-weight blocks along 128 and 64)
    spec = dataclasses.replace(spec, expert_types=(("mxfp4",) * 3,) * spec.num_layers,
                               layer_types=(("q8_0",) * 7,) * spec.num_layers)
    exported = {f.name: f for f in export_functions(spec, act_dtype="float16")}
    assert exported["post_moe"].weight_names == spec.post_attn_weight_names(0)
    assert exported["expert"].weight_names == ("gate", "up", "down", "b_gate", "b_up", "b_down")
    mod = import_functions(tuple(exported.values()), ())
    params = {str(g.name_hint): len(mod[g].params) for g in mod.functions if str(g.name_hint).startswith(("post_moe",
                                                                                                          "expert"))}
    assert params == {"post_moe_prefill": 7, "post_moe_decode": 7, "expert_prefill": 7, "expert_decode": 7}, params
    out = str(tmp_path / "gpu")
    os.makedirs(out)
    names = compile_gpu(mod, h200(), out, spec)
    assert "gpu_stage.sm_90.cubin" in names and os.path.getsize(os.path.join(out, "gpu_stage.sm_90.cubin")) > 0
    cu = gpu_cuda_source(out)
    kernels = set(re.findall(r"__launch_bounds__\(\d+\) (\w+)\(", cu))
    # gate/up [64, 128] and down [128, 64]: the MXFP4 GEMV of a decode row, the dequantizer of a prompt's GEMM
    for want in ("helmc_gpu_gemv_mxfp4_n64_k128", "helmc_gpu_gemv_mxfp4_n128_k64",
                 "helmc_gpu_dequantize_mxfp4_n64_k128", "helmc_gpu_dequantize_mxfp4_n128_k64"):
        assert any(k.startswith(want) for k in kernels), (want, sorted(kernels)[:20])
    assert any(re.fullmatch(r"fused_\w*where\w*sigmoid\w*_kernel", k) for k in kernels)
    # VRAM experts' decode rows: the biased two-launch kernels, one row and m rows, the GPU library's by these names
    want = [n + "_kernel" for f in (gpu_moe_names, gpu_moe_rows_names)
            for n in f("mxfp4", "mxfp4", 8, 64, 128, biased=True)]
    assert set(want) <= kernels, (want, sorted(k for k in kernels if "moe" in k))
    body = cu[cu.rindex(f"void __launch_bounds__(128) {want[0]}("):]
    body = body[:body.index("__global__")] if "__global__" in body else body
    assert spec.moe.swiglu_limit == 0.5 and "-0x1p-1f" in body and "-0x1.b3b6" in body   # the model's clamp, -alpha
