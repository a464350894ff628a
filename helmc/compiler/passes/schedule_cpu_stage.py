"""Compile the CPU stage's Relax functions for the LLVM target of the machine the bundle is built *for*.

    compile_cpu_stage(mod, features, spec=None, cores=0, prefill_activations="model") -> tvm.runtime.Executable   (export_library it)
    llvm_target(features)           -> tvm.target.Target
    required_cpu_features(features) -> the /proc/cpuinfo flags the compiled code executes (bundle manifest)

Pipeline: lower_linear (every linear -> helmc's GEMV/GEMM, weights read in their stored dtype; decode q/k/v
fused into one GEMV launch and gate/up into one that writes the SwiGLU product; prefill on AMX tiles where
the target has amx_tile + amx_bf16) -> TVM's
CPU legalisation (after expand_sigmoid / expand_gelu_tanh + FastMathTransform: the SwiGLU's exp and the GeGLU's
tanh vectorised) and fusion -> schedule_elementwise (parallel + vectorised loops for the fused norm / RoPE /
SwiGLU / residual functions that TVM leaves serial) -> TVM's VM lowering. With the ModelSpec given, the
decode-attention kernel over the CPU layers' 16-bit KV (schedules/cpu/decode_attention.py) is added as a
global PrimFunc, so it ships inside cpu_stage.so; the runtime finds it by name (kv_cache_cpu.find_decode_kernel)
and keeps its NumPy path for bundles without it. Features are hardware.json's CPU
flags, never the build machine's, so a bundle built here for the GPU machine's Xeon uses AVX-512.
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax

from helmc.compiler.passes.expand_gelu_tanh import expand_gelu_tanh
from helmc.compiler.passes.expand_sigmoid import expand_sigmoid
from helmc.compiler.passes.lower_linear import lower_linear
from helmc.model.spec import ModelSpec
from helmc.schedules.cpu.decode_attention import default_max_splits, make_decode_attention
from helmc.schedules.cpu.elementwise import schedule_elementwise
from helmc.schedules.cpu.isa import select_isa

log = logging.getLogger(__name__)


def llvm_target(features: tuple[str, ...]) -> tvm.target.Target:
    isa = select_isa(features)
    if isa.is_slow_fallback:
        log.warning("CPU stage: the target CPU lacks AVX2/FMA/F16C; compiling the portable x86-64 fallback, "
                    "which is correct but several times below DRAM bandwidth (the CPU stage will be slow)")
    spec: dict = {"kind": "llvm", "mcpu": isa.llvm_mcpu}
    if isa.llvm_mattr:
        spec["mattr"] = list(isa.llvm_mattr)
    return tvm.target.Target(spec)


def required_cpu_features(features: tuple[str, ...]) -> tuple[str, ...]:
    """/proc/cpuinfo flags a CPU must have to run what compile_cpu_stage(mod, features) produces."""
    return select_isa(features).required_flags


def cpu_stage_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's CPU pipeline (relax/backend/cpu_generic) with the elementwise scheduling step added."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

    @tvm.transform.module_pass(opt_level=0, name="HelmcCpuStagePipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            passes = (
                [relax.transform.DecomposeOpsForInference(), expand_sigmoid(), expand_gelu_tanh(),
                 relax.transform.FastMathTransform()]
                + cpu_generic.library_dispatch_passes(target)
                + cpu_generic.legalize_passes(target)
                + [schedule_elementwise(target)]
                + cpu_generic.dataflow_lower_passes(target)
                + cpu_generic.finalize_passes(target)
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def decode_attention_kernels(spec: ModelSpec, features: tuple[str, ...], cores: int = 0) -> dict:
    """{global symbol: PrimFunc}: decode attention over the KV dtype the CPU stage stores (the model's dtype).
    float32 models keep float32 KV and the NumPy path, so they get none. `cores`: the target CPU's cores
    (hardware.json), which sets the split count; 0 means 16."""
    if spec.dtype == "float32":
        return {}
    f = make_decode_attention(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, select_isa(features),
                              default_max_splits(cores or 16, spec.num_kv_heads))
    return {str(f.attrs["global_symbol"]): f}


def moe_expert_kernels(spec: ModelSpec, features: tuple[str, ...]) -> dict:
    """{global symbol: PrimFunc}: the one-call decode expert sums (schedules/cpu/quant/moe_experts.py, one row;
    moe_experts_rows.py, a batched step's rows) of each
    routed expert type signature whose gate/up and down types have int8 kernels on this CPU; the runtime looks
    each up by name and calls the expert function per expert where one is absent. gpt-oss's biased, clamped experts
    (MoeSpec.biased_experts) take the kernels' biased form (BiasedExperts)."""
    if spec.moe is None or not (spec.moe.plain_experts or spec.moe.biased_experts):
        return {}
    from helmc.schedules.cpu.quant.moe_experts import BiasedExperts, make_moe_expert_sum, moe_expert_sum_applies
    from helmc.schedules.cpu.quant.moe_experts_rows import make_moe_expert_rows
    isa, moe, out = select_isa(features), spec.moe, {}
    biased = BiasedExperts(moe.swiglu_alpha, moe.swiglu_limit) if moe.biased_experts else None
    for gate, up, down in spec.expert_signatures():
        if gate == up and moe_expert_sum_applies(gate or None, down or None, moe.expert_intermediate_size,
                                                 spec.hidden_size, isa):
            for make in (make_moe_expert_sum, make_moe_expert_rows):     # one decode row; a batched step's m rows
                f = make(gate, down, moe.num_experts, moe.expert_intermediate_size, spec.hidden_size, moe.top_k, isa,
                         biased)
                out[str(f.attrs["global_symbol"])] = f
    return out


def compile_cpu_stage(mod: tvm.IRModule, features: tuple[str, ...], spec: ModelSpec | None = None,
                      cores: int = 0, prefill_activations: str = "model") -> tvm.runtime.Executable:
    target = llvm_target(features)
    weight_types = {}
    if spec is not None and spec.quantized:
        from helmc.compiler.passes.quantize_functions import quantize_functions
        mod, weight_types = quantize_functions(mod, spec)
    lowered = lower_linear(mod, features, cores or None, prefill_activations, weight_types)
    if spec is not None:
        kernels = {**decode_attention_kernels(spec, features, cores), **moe_expert_kernels(spec, features)}
        for name, func in kernels.items():
            lowered[name] = func
    return tvm.compile(lowered, target=target, relax_pipeline=cpu_stage_pipeline(target))
