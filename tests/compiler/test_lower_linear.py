"""lower_linear + compile_cpu_stage on a small exported Qwen3 block (the pipeline's own export).

Checks: every projection becomes a call to helmc's kernel (GEMV for decode, GEMM for prefill) and no fp32
copy of a 2-D weight is left; the compiled functions match (a) the same module compiled by TVM's default
pipeline and (b) torch in float32. No stored references: both are recomputed on every run.
"""
from __future__ import annotations


import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
torch = pytest.importorskip("torch")
pytest.importorskip("onnx")


from benchmarks.bench_cpu_block import qwen3_spec, torch_block  # noqa: E402

from helmc.runtime.tvm_tensors import bf16_bits_from_float32, tensor_from_numpy  # noqa: E402
from helmc.schedules.cpu.isa import missing_flags  # noqa: E402
from helmc.runtime.bundle.manifest import host_cpu_flags  # noqa: E402

AVX2 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
AMX = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16")



pytestmark = pytest.mark.skipif(missing_flags(AVX2, host_cpu_flags()) != (), reason="this CPU lacks AVX2/FMA/F16C")


@pytest.fixture(scope="module")
def block():
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    # Odd-ish sizes: hidden 192 and ffn 328 are multiples of 8 but not of the 32-wide GEMV chunk.
    spec = qwen3_spec("8b", "bfloat16", hidden_size=192, intermediate_size=328, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32)
    exported = tuple(f for f in export_functions(spec) if f.name in ("pre_attn", "post_attn"))
    return spec, exported, import_functions(exported)


@pytest.fixture(scope="module")
def amx_lowered(block):
    """lower_linear_with_report of the block for a 3-core AMX target, once for the tests that read it (the core
    count sets only the AMX GEMMs' parallel task count, which one of them checks; kernel choice and names ignore it)."""
    from helmc.compiler.passes.lower_linear import lower_linear_with_report
    return lower_linear_with_report(block[2], AMX, cores=3)


def test_every_linear_is_lowered_and_no_fp32_weight_copy_remains(block):
    from tvm import relax
    from helmc.compiler.passes.lower_linear import lower_linear_with_report
    spec, _, mod = block
    lowered, report = lower_linear_with_report(mod, AVX2)
    per_function = {}
    for item in report:
        per_function.setdefault(item.function, []).append(item)
    assert {k: len(v) for k, v in per_function.items()} == {
        "pre_attn_prefill": 3, "pre_attn_decode": 3, "post_attn_prefill": 4, "post_attn_decode": 4}
    # Decode: q/k/v are one launch, gate/up one launch that writes the SwiGLU product, o and down plain GEMVs.
    post_kernels = [i.kernel for i in per_function["post_attn_decode"]]
    assert sum(k.startswith("helmc_gemv_swiglu_bf16_m1_") for k in post_kernels) == 2, post_kernels
    assert sum(k.startswith("helmc_gemv_bf16_m1_") for k in post_kernels) == 2, post_kernels
    assert {i.kernel for i in per_function["pre_attn_decode"]} == {
        f"helmc_gemv3_bf16_m1_n{spec.q_dim}_{spec.kv_dim}_{spec.kv_dim}_k{spec.hidden_size}"}
    assert all(i.kernel.startswith("helmc_gemm_bf16_") and i.tokens == "seq" for i in per_function["pre_attn_prefill"])

    leftovers = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.name in ("relax.astype", "relax.matmul") and expr.args[0].ty.ndim == 2:
                leftovers.append(expr.op.name)

    sigmoids = []
    for gvar, func in lowered.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
            relax.analysis.post_order_visit(func, lambda e, name=gvar.name_hint: sigmoids.append(name) if (
                isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.sigmoid") else None)
    assert leftovers == [], f"un-lowered 2-D astype/matmul left: {leftovers}"
    assert sigmoids == ["post_attn_prefill"], f"SwiGLU's sigmoid should remain only in prefill: {sigmoids}"
    relax.analysis.well_formed(lowered)  # raises on an ill-formed module (TVM 0.27 returns None)


def test_compiled_stage_matches_default_pipeline_and_torch(block):
    from tvm import relax
    from helmc.compiler.passes.schedule_cpu_stage import compile_cpu_stage
    from helmc.compiler.passes.lower_linear import lower_linear  # noqa: F401  (compile_cpu_stage applies it)
    spec, exported, mod = block
    dev = tvm.cpu()
    vm = relax.VirtualMachine(compile_cpu_stage(mod, AVX2), dev)
    # TVM's own lowering of the un-lowered module as the first reference (fresh vars per function,
    # as lower_linear does: the decode variant shares parameter Vars with the prefill one).
    fresh = tvm.IRModule({gv: relax.utils.copy_with_new_vars(f) for gv, f in mod.functions_items()})
    ref_vm = relax.VirtualMachine(tvm.compile(relax.transform.DecomposeOpsForInference()(fresh),
                                              target=tvm.target.Target({"kind": "llvm"})), dev)
    shapes = spec.block_weight_shapes()
    rng = np.random.default_rng(3)
    names = {f.name: f.weight_names for f in exported}
    bits = {}
    for n in names["pre_attn"] + names["post_attn"]:
        shape = shapes[n]
        vals = 1 + 0.1 * rng.standard_normal(shape, dtype=np.float32) if len(shape) == 1 else \
            rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])
        bits[n] = bf16_bits_from_float32(vals)
    w = {n: tensor_from_numpy(b, "bfloat16", dev) for n, b in bits.items()}
    w32 = {n: torch.from_numpy((b.astype(np.uint32) << 16).view(np.float32)) for n, b in bits.items()}
    pre_t, post_t = torch_block(spec, torch.float32)
    D = spec.head_dim
    for kind, seq in (("decode", 1), ("prefill", 6)):
        x = rng.standard_normal((seq, spec.hidden_size), dtype=np.float32)
        ang = np.arange(seq)[:, None] * (spec.rope.theta ** (-np.arange(0, D, 2) / D))
        cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
        sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)
        attn = rng.standard_normal((seq, spec.q_dim), dtype=np.float32)
        args_pre = [tensor_from_numpy(a, "float32", dev) for a in (x, cos, sin)] + [w[n] for n in names["pre_attn"]]
        args_post = [tensor_from_numpy(a, "float32", dev) for a in (x, attn)] + [w[n] for n in names["post_attn"]]
        got = list(vm[f"pre_attn_{kind}"](*args_pre)) + [vm[f"post_attn_{kind}"](*args_post)]
        tvm_ref = list(ref_vm[f"pre_attn_{kind}"](*args_pre)) + [ref_vm[f"post_attn_{kind}"](*args_post)]
        with torch.no_grad():
            tx = [torch.from_numpy(a) for a in (x, cos, sin, attn)]
            torch_ref = list(pre_t(tx[0], tx[1], tx[2], w32)) + [post_t(tx[0], tx[3], w32)]
        for name, g, r, t in zip(("q", "k", "v", "y"), got, tvm_ref, torch_ref):
            g = g.numpy()
            err_tvm = float(np.abs(g - r.numpy()).max() / np.abs(r.numpy()).max())
            err_torch = float(np.abs(g - t.numpy()).max() / np.abs(t.numpy()).max())
            print(f"{kind} {name}: rel err vs TVM default {err_tvm:.1e}, vs torch fp32 {err_torch:.1e}")
            assert err_tvm <= 1e-4 and err_torch <= 1e-4


def test_prefill_uses_amx_gemm_only_for_whole_tiles_on_an_amx_target(block, amx_lowered):
    from helmc.compiler.passes.lower_linear import lower_linear_with_report
    spec, _, mod = block
    amx = AMX
    _, report = amx_lowered
    prefill = [i for i in report if i.function.endswith("_prefill")]
    for item in prefill:
        whole = item.out_features % 32 == 0 and item.in_features % 32 == 0
        # the block's weights are bf16; q/k/v share x and are one fused launch ("gemm3")
        assert (item.kernel.startswith("helmc_gemm_amx_bf16_") or item.kernel.startswith("helmc_gemm3_amx_bf16_")) \
            == whole, item
    assert any(i.kernel.startswith("helmc_gemm3_amx_") for i in prefill)
    assert not any("amx" in i.kernel for i in lower_linear_with_report(mod, AVX2)[1])
    # The target's core count sets the AMX GEMM's parallel tasks: one contiguous group of 32-row panels each
    # (a fused launch's panels are those of all its weights).
    out, report = amx_lowered
    panels_of = {}
    for item in report:
        if "amx" in item.kernel:
            panels_of.setdefault((item.function, item.kernel), []).append(item.out_features // 32)
    for (_, kernel), per_weight in panels_of.items():
        panels = sum(per_weight)
        tasks = -(-panels // -(-panels // 3))
        assert f"for task in T.parallel({tasks}):" in out[kernel].script(), (kernel, tasks)


def test_fp32_prefill_activations_build_the_split_amx_gemms(block, amx_lowered):
    """--prefill-activations fp32: every bf16 AMX GEMM is the hi + lo kernel ("_xsplit"); "model" none of them;
    decode GEMVs are the same kernels either way; anything else is refused, naming the choices."""
    from helmc.errors import HelmcError
    from helmc.compiler.passes.lower_linear import lower_linear_with_report
    _, _, mod = block
    amx = AMX
    model = {i.kernel for i in amx_lowered[1]}
    fp32 = {i.kernel for i in lower_linear_with_report(mod, amx, prefill_activations="fp32")[1]}
    amx_model = {k for k in model if "_amx_" in k}
    assert amx_model and not any(k.endswith("_xsplit") for k in model)
    assert {k for k in fp32 if "_amx_" in k} == {k + "_xsplit" for k in amx_model}
    assert {k for k in fp32 if "_amx_" not in k} == model - amx_model
    with pytest.raises(HelmcError, match=r"prefill activations: expected one of \('model', 'fp32'\), found 'bf16'"):
        lower_linear_with_report(mod, amx, prefill_activations="bf16")


def amx_block(hidden, ffn, heads, kv_heads, head_dim, dtype="bfloat16"):
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    spec = qwen3_spec("8b", dtype, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim)
    return import_functions(tuple(f for f in export_functions(spec) if f.name in ("pre_attn", "post_attn")))


def test_prefill_fuses_qkv_and_gate_up_into_one_amx_launch_each_with_per_shape_blocking():
    """All tile-aligned: q/k/v -> one 3-weight AMX launch, gate/up -> one 2-weight launch (both outputs),
    o and down alone. Blocking per launch from gemm_amx.blocking_for(summed N, K, dtype), unless the
    benchmark override is set."""
    from helmc.compiler.passes.lower_linear import lower_linear_with_report
    from helmc.schedules.cpu import gemm_amx
    mod = amx_block(128, 320, 2, 1, 64)
    amx = AMX
    _, report = lower_linear_with_report(mod, amx)
    kernels = {}
    for item in report:
        if item.function.endswith("_prefill"):
            kernels.setdefault(item.kernel, []).append(item.out_features)
    print(kernels)
    assert kernels == {"helmc_gemm3_amx_bf16_n128_64_64_k128": [128, 64, 64],
                       "helmc_gemm_amx_bf16_n128_k128": [128],
                       "helmc_gemm2_amx_bf16_n320_320_k128": [320, 320],
                       "helmc_gemm_amx_bf16_n128_k320": [128]}
    assert gemm_amx.blocking_for(128 + 64 + 64, 128, "bfloat16").name == ""    # small N: the default
    gemm_amx.BLOCKING_OVERRIDE = gemm_amx.blocking_named("kc512")
    try:
        _, report = lower_linear_with_report(mod, amx)
    finally:
        gemm_amx.BLOCKING_OVERRIDE = None
    assert all(i.kernel.endswith("_kc512") for i in report if "amx" in i.kernel), report


def test_fp16_block_compiles_with_amx_prefill_for_an_amx_target():
    """Cross-compile only (this CPU may lack AMX): an fp16 block must get fp16 AMX kernels, not bf16 ones."""
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.passes.lower_linear import lower_linear_with_report
    from helmc.compiler.passes.schedule_cpu_stage import compile_cpu_stage
    spec = qwen3_spec("8b", "float16", hidden_size=64, intermediate_size=96, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32)
    mod = import_functions(tuple(f for f in export_functions(spec) if f.name in ("pre_attn", "post_attn")))
    amx = AMX
    kernels = {i.kernel for i in lower_linear_with_report(mod, amx)[1] if i.function.endswith("_prefill")}
    assert kernels and all(k.split("_amx_")[1].startswith("f16_") for k in kernels), kernels
    assert any(k.startswith("helmc_gemm3_amx_f16_") for k in kernels), kernels   # fused q/k/v
    compile_cpu_stage(mod, amx)   # raised in CallTIRRewrite when the kernel cache ignored the weight dtype
