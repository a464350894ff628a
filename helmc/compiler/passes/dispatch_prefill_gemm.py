"""Relax pass: the GPU stage's prefill matmuls on tensor cores, through cuBLAS at run time.

dlight's tensor-core matmul rules crash in this TVM (device-notes), and its SIMT schedule ran the 128-token
prompt's [128, 4096] @ [4096, 12288] fp16 matmul in 799 us where cuBLAS took 42.8 us in the same run
(measured on the GPU machine): prefill, and so TTFT, was ~8x llama.cpp's. The GPU machine's runtime-only
TVM has no cuBLAS contrib, but the runtime already carries CuPy, whose matmul is cuBLAS's GEMM on tensor
cores. So each prefill linear

    astype(matmul(x, permute_dims(w), out_dtype="float32"), "float16")     x fp16 [seq, K], w fp16 [N, K]

(the form rewrite_matmuls_fp32_accumulate leaves, quantized weights already dequantized to fp16) becomes
`R.call_dps_packed("helmc.gemm_nt_f16", (x, w), [seq, N] fp16)`, which runtime/cuda_runtime.py registers:
y = x @ w^T summed in fp32 and rounded once to fp16, the same result up to summation order, on the session's
stream. Only functions with a symbolic token count are touched: decode keeps its GEMV kernels and its CUDA
graph (no host callback inside a captured step). bf16 weights are left to TVM (x is fp16; cuBLAS would need
the weight converted first).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

GEMM_FUNC = "helmc.gemm_nt_f16"     # the runtime registers a packed function of this name (cuda_runtime.py)


def dispatch_prefill_gemm(mod: tvm.IRModule) -> tvm.IRModule:
    rewriter = _PrefillGemm(mod)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not _static_tokens(func):
            new = relax.analysis.remove_all_unused(rewriter.visit_expr(func))
            rewriter.builder_.update_func(gvar, new)
    return rewriter.builder_.get()


def _static_tokens(func: relax.Function) -> bool:
    """Whether the first parameter (the activations, [seq, ...]) has a static token count."""
    shape = getattr(func.params[0].ty, "shape", None)
    return shape is not None and hasattr(shape, "values") and isinstance(shape.values[0], tvm.tirx.IntImm)


@mutator
class _PrefillGemm(PyExprMutator):
    def _bound(self, expr, op: str):
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        return value if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(f"relax.{op}") else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.astype") or str(call.attrs.dtype) != "float16":
            return call
        mm = self._bound(call.args[0], "matmul")
        if mm is None or str(mm.attrs.out_dtype) != "float32":
            return call
        x, wt = mm.args
        perm = self._bound(wt, "permute_dims")
        if perm is None:
            return call
        w = perm.args[0]
        if str(x.ty.dtype) != "float16" or str(w.ty.dtype) != "float16" or x.ty.ndim != 2 or w.ty.ndim != 2:
            return call
        if perm.attrs.axes is not None and [int(a) for a in perm.attrs.axes] != [1, 0]:
            return call
        seq, n = x.ty.shape.values[0], w.ty.shape.values[0]
        return relax.call_dps_packed(GEMM_FUNC, [x, w], relax.TensorType([seq, n], "float16"))
