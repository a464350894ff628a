"""Relax pass for the CPU stage: sigmoid(x) -> 1 / (1 + exp(-x)), so FastMathTransform makes its exp vectorisable.

Why: TVM legalises R.sigmoid to the `tirx.sigmoid` intrinsic, which the LLVM backend lowers through `llvm.exp`;
without a vector math library LLVM scalarises that into one `expf` call per element, so the prefill's SwiGLU
(128 x 12288 elements for an 8B block) stayed the slowest non-GEMM kernel even when parallel: 0.56 ms of a
6.0 ms Qwen3-8B block prefill on a 16-core Sapphire Rapids Xeon.
Spelled with R.exp, FastMathTransform (run right after this pass) turns the exp into topi's fast_exp, a clamped
polynomial of plain arithmetic and bit operations that vectorises; its relative error is ~1e-7.
Near and beyond its clamp (x < -87) sigmoid's quotient is denormal and may flush to zero, so silu(x) =
x * sigmoid(x) is 0 where the truth is below ~1e-36 in magnitude (tests/compiler/test_expand_sigmoid.py).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


@mutator
class _SigmoidExpander(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.sigmoid"):
            return call
        x = call.args[0]
        dtype = str(getattr(x.ty.dtype, "dtype", x.ty.dtype))
        one = relax.const(1.0, dtype)
        denominator = self.builder_.emit(relax.op.add(one, self.builder_.emit(relax.op.exp(
            self.builder_.emit(relax.op.negative(x))))))
        return relax.op.divide(one, denominator)


def expand_sigmoid() -> tvm.transform.Pass:
    """Module pass: every R.sigmoid in every Relax function becomes 1 / (1 + exp(-x))."""

    @tvm.transform.module_pass(opt_level=0, name="HelmcExpandSigmoid")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        expander = _SigmoidExpander(mod)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                expander.builder_.update_func(gvar, expander.visit_expr(func))
        return expander.builder_.get()

    return _pass
