"""Relax pass for the CPU stage: gelu_tanh(x) -> 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))) spelled with
R.tanh, so FastMathTransform makes the tanh vectorisable.

Why: Gemma 3's GeGLU (gelu_pytorch_tanh; ONNX's Gelu with approximate="tanh") imports as R.nn.gelu_tanh, whose
legalisation calls the `tirx.tanh` intrinsic; the LLVM backend lowers that through `llvm.exp`, and without a
vector math library LLVM scalarises it into one `expf` call per element. A decode row of a Gemma-3-12B block
(15360 elements, below schedule_elementwise's parallel threshold) then took ~170 us on one core of the 2-core
build host, the whole of a q4_k block's GEMV time for a sixth of its bytes; a prefill's rows as many again per row.
Spelled with R.tanh, FastMathTransform (run right after this pass) turns it into topi's fast_tanh, a clamped
rational polynomial of plain arithmetic that vectorises (tests/compiler/test_expand_gelu_tanh.py: within 1e-6
of float64 over the block). The formula is the legalisation's own, x (1 + c x^2) for x + c x^3.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


@mutator
class _GeluTanhExpander(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.gelu_tanh"):
            return call
        x = call.args[0]
        dtype = str(getattr(x.ty.dtype, "dtype", x.ty.dtype))
        emit = self.builder_.emit

        def const(v: float) -> relax.Constant:
            return relax.const(v, dtype)

        cubic = emit(relax.op.add(const(1.0), emit(relax.op.multiply(
            const(0.044715), emit(relax.op.multiply(x, x))))))                          # 1 + c x^2
        inner = emit(relax.op.multiply(emit(relax.op.multiply(const(math.sqrt(2.0 / math.pi)), x)), cubic))
        half_x = emit(relax.op.multiply(const(0.5), x))
        return relax.op.multiply(half_x, emit(relax.op.add(const(1.0), emit(relax.op.tanh(inner)))))


def expand_gelu_tanh() -> tvm.transform.Pass:
    """Module pass: every R.nn.gelu_tanh in every Relax function becomes its formula over R.tanh."""

    @tvm.transform.module_pass(opt_level=0, name="HelmcExpandGeluTanh")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        expander = _GeluTanhExpander(mod)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                expander.builder_.update_func(gvar, expander.visit_expr(func))
        return expander.builder_.get()

    return _pass
