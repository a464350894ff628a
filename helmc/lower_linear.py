"""Relax pass: replace every exported linear layer with a call to the CPU stage's own GEMV/GEMM kernel.

torch.onnx.export of `F.linear(h, w.to(torch.float32))` imports into Relax as
    wf = R.astype(w, "float32")          # w: (N, K) float16 / bfloat16, HF layout
    wt = R.permute_dims(wf, [1, 0])
    y  = R.matmul(h, wt)                 # h: (..., K) float32
TVM's default lowering materialises `wf` (a full fp32 copy of the weight, 3x the bytes of the fp16 layer) and
runs an unscheduled matmul over it. This pass rewrites `y` to `R.call_tir(kernel, (h2d, w), ...)`, where the
kernel reads `w` in its stored dtype and accumulates in fp32 (schedules/cpu/gemv.py, gemm.py), and removes
the then-unused astype/permute_dims bindings, so no fp32 copy of a weight ever exists.

Kernel choice per call: a static token count <= GEMV_MAX_ROWS (decode) -> GEMV specialised to that count;
a symbolic or larger count (prefill) -> GEMM with a symbolic token dimension.

Weights stay in HF's row-major [N, K] layout: both kernels stream it as stored (the GEMV reaches the DRAM
ceiling on it, see scripts/bench_cpu_gemv.py), so no repacking is recorded in the bundle.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.utils import copy_with_new_vars

from helmc.schedules.cpu.gemm import make_gemm
from helmc.schedules.cpu.gemv import GEMV_MAX_ROWS, make_gemv
from helmc.schedules.cpu.isa import VectorIsa, select_isa
from helmc.schedules.cpu.weight_load import WEIGHT_DTYPES


@dataclass(frozen=True)
class LoweredLinear:
    """One rewritten matmul, for the build log and tests."""
    function: str       # Relax function it was in
    kernel: str         # PrimFunc global symbol
    tokens: str         # static count or the symbolic dimension's name
    out_features: int
    in_features: int
    weight_dtype: str


def lower_linear(mod: tvm.IRModule, features: tuple[str, ...]) -> tvm.IRModule:
    """Every astype/permute_dims/matmul linear in every Relax function -> call_tir to a CPU kernel."""
    return lower_linear_with_report(mod, features)[0]


def lower_linear_with_report(mod: tvm.IRModule, features: tuple[str, ...]
                             ) -> tuple[tvm.IRModule, tuple[LoweredLinear, ...]]:
    rewriter = _LinearRewriter(mod, select_isa(features))
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        rewriter.function_name = gvar.name_hint
        # Fresh variables per function: a decode variant made by binding `seq` in the prefill function
        # shares its parameter Vars, which Relax's FuseOps rejects ("appears at multiple definition sites").
        new_func = rewriter.visit_expr(copy_with_new_vars(func))
        rewriter.builder_.update_func(gvar, relax.analysis.remove_all_unused(new_func))
    out = rewriter.builder_.get()
    for lowered in rewriter.lowered:
        assert lowered.kernel in {g.name_hint for g in out.get_global_vars()}, lowered
    return out, tuple(rewriter.lowered)


def _dtype_name(ty) -> str:
    """'float16' from a TensorType's dtype (a PrimType in TVM 0.27, whose str() is 'T.float16')."""
    dtype = ty.dtype
    return str(getattr(dtype, "dtype", dtype))


def _static_int(dim) -> int | None:
    return int(dim.value) if isinstance(dim, tirx.IntImm) else None


@mutator
class _LinearRewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, isa: VectorIsa):
        super().__init__(mod)
        self.isa = isa
        self.kernels: dict[tuple, relax.GlobalVar] = {}
        self.lowered: list[LoweredLinear] = []
        self.function_name = ""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        matched = self._match_linear(call)
        if matched is None:
            return call
        x, weight = matched
        return self._emit_kernel_call(x, weight)

    def _resolve(self, expr: relax.Expr) -> relax.Expr:
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                return bound
        return expr

    def _match_linear(self, call: relax.Call) -> tuple[relax.Expr, relax.Expr] | None:
        """(x, weight) when `call` is matmul(x, permute_dims(astype?(weight))) with a 2-D weight read as
        x @ weight.T, fp32 activations and a supported weight dtype; None leaves the call as it was."""
        if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.matmul":
            return None
        x, rhs = call.args
        transpose = self._resolve(rhs)
        if not (isinstance(transpose, relax.Call) and transpose.op.name == "relax.permute_dims"):
            return None
        axes = transpose.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        weight = transpose.args[0]
        widened = self._resolve(weight)
        if isinstance(widened, relax.Call) and widened.op.name == "relax.astype":
            if str(widened.attrs.dtype) != "float32":
                return None
            weight = widened.args[0]
        w_ty, x_ty = weight.ty, x.ty
        if not isinstance(w_ty, relax.TensorType) or not isinstance(x_ty, relax.TensorType):
            return None
        if w_ty.ndim != 2 or x_ty.ndim < 2 or _dtype_name(x_ty) != "float32" or _dtype_name(w_ty) not in WEIGHT_DTYPES:
            return None
        if w_ty.shape is None or x_ty.shape is None:
            return None
        n, k = (_static_int(d) for d in w_ty.shape.values)
        if n is None or k is None or _static_int(x_ty.shape.values[-1]) != k:
            return None
        if _dtype_name(call.ty) != "float32":
            return None
        return x, weight

    def _emit_kernel_call(self, x: relax.Expr, weight: relax.Expr) -> relax.Expr:
        n, k = (int(d) for d in weight.ty.shape.values)
        dtype = _dtype_name(weight.ty)
        x_dims = list(x.ty.shape.values)
        tokens_dims = x_dims[:-1]
        tokens = tokens_dims[0]
        for d in tokens_dims[1:]:
            tokens = tokens * d
        if len(tokens_dims) > 1:
            from tvm.sym.analyzer import Analyzer
            tokens = Analyzer().simplify(tokens)
        x2d = x
        if len(x_dims) != 2:
            x2d = self.builder_.emit(relax.op.reshape(x, relax.ShapeExpr([tokens, k])))  # (..., K) -> (T, K)
        static_tokens = _static_int(tokens)
        if static_tokens is not None and static_tokens <= GEMV_MAX_ROWS:
            key = ("gemv", static_tokens, n, k, dtype)
            make = lambda: make_gemv(static_tokens, n, k, dtype, self.isa)  # noqa: E731
        else:
            key = ("gemm", n, k, dtype)
            make = lambda: make_gemm(n, k, dtype, self.isa)  # noqa: E731
        if key not in self.kernels:
            prim = make()
            self.kernels[key] = self.builder_.add_func(prim, str(prim.attrs["global_symbol"]))
        gvar = self.kernels[key]
        out = relax.call_tir(gvar, [x2d, weight], relax.TensorType([tokens, n], "float32"))
        self.lowered.append(LoweredLinear(self.function_name, gvar.name_hint, str(tokens), n, k, dtype))
        if len(x_dims) != 2:
            out = self.builder_.emit(out)
            return relax.op.reshape(out, relax.ShapeExpr(tokens_dims + [n]))  # (T, N) -> (..., N)
        return out
