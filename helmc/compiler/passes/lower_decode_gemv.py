"""Relax pass: the GPU stage's decode linears over fp16 / bf16 weights -> helmc's own GEMV (schedules/gpu/gemv.py).

In every decode function -- `decode` (one row) and the batched `decode_b{B}` variants (import_relax: B rows, one
per sequence), of every weight signature -- a linear
    y = matmul(x, permute_dims(astype?(w)))        x: [m, K] fp16, w: [N, K] fp16 / bf16, m <= gemv.MAX_ROWS
becomes `call_tir(make_gpu_gemv(m, N, K, dtype(w)), [x, w])`: w read as stored, fp32 sums, y rounded to fp16
once, as the matmul computed before (compile_gpu_stage.rewrite_matmuls_fp32_accumulate). The kernel forms every
row of y the same way whatever m is, so a batched decode step gives each sequence the bits of its own decode
step (issue 19), which dlight's GEMV (m = 1) and LowBatchGEMV (m > 1) schedules did not promise. fp32 weights
keep their cast to fp16 (the kernel reads the cast copy, as the matmul did).
Runs after lower_quantized_gpu (quantized weights are raw blocks by then, with their own m-row GEMV) and
before rewrite_matmuls_fp32_accumulate, which then sees only the prefill matmuls; a linear this pass does not
take (K not a multiple of 8, activations other than fp16) is left to dlight as before.
"""
from __future__ import annotations

import re

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from helmc.schedules.gpu.gemv import MAX_ROWS, VEC, WEIGHT_DTYPES, make_gpu_gemv

DECODE = re.compile(r"_decode(_b\d+)?(_t\d+)?$")     # runtime.stage.block_function_name's decode functions


def lower_decode_gemv(mod: tvm.IRModule) -> tvm.IRModule:
    rewriter = _DecodeLinears(mod)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and DECODE.search(gvar.name_hint):
            body = rewriter.visit_expr(func.body)
            new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
            rewriter.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
    return rewriter.builder_.get()


def _static_shape(expr) -> list[int] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values
    return [int(d.value) for d in dims] if all(isinstance(d, tvm.tirx.IntImm) for d in dims) else None


@mutator
class _DecodeLinears(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.kernels: dict = {}

    def _bound(self, expr):
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr

    def _weight(self, rhs):
        """The [N, K] 16-bit weight under permute_dims(astype?(w)) (the cast stripped when w is fp16 / bf16:
        the kernel widens it exactly), or None."""
        perm = self._bound(rhs)
        if not (isinstance(perm, relax.Call) and perm.op == tvm.ir.Op.get("relax.permute_dims")):
            return None
        axes = perm.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        w = perm.args[0]
        cast = self._bound(w)
        if isinstance(cast, relax.Call) and cast.op == tvm.ir.Op.get("relax.astype") \
                and str(cast.args[0].ty.dtype) in WEIGHT_DTYPES:
            w = cast.args[0]
        return w if str(w.ty.dtype) in WEIGHT_DTYPES and _static_shape(w) is not None else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        x, w = call.args[0], self._weight(call.args[1])
        xs = _static_shape(x)
        if w is None or xs is None or len(xs) != 2 or str(x.ty.dtype) != "float16":
            return call
        (m, k), (n, k_w) = xs, _static_shape(w)
        if k != k_w or not 1 <= m <= MAX_ROWS or k % VEC:
            return call
        dtype = str(w.ty.dtype)
        key = (m, n, k, dtype)
        if key not in self.kernels:
            prim = make_gpu_gemv(m, n, k, dtype)
            self.kernels[key] = self.builder_.add_func(prim, str(prim.attrs["global_symbol"]))
        y = relax.call_tir(self.kernels[key], [x, w], relax.TensorType([m, n], "float16"))
        out_dtype = str(call.ty.dtype)
        return y if out_dtype == "float16" else relax.op.astype(self.builder_.emit(y), out_dtype)
