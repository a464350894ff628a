"""Relax pass: replace every exported linear layer with a call to the CPU stage's own GEMV/GEMM kernel.

torch.onnx.export of `F.linear(h, w.to(torch.float32))` imports into Relax as
    wf = R.astype(w, "float32")          # w: (N, K) float16 / bfloat16, HF layout
    wt = R.permute_dims(wf, [1, 0])
    y  = R.matmul(h, wt)                 # h: (..., K) float32
TVM's default lowering materialises `wf` (a full fp32 copy of the weight, 3x the bytes of the fp16 layer) and
runs an unscheduled matmul over it. This pass rewrites `y` to `R.call_tir(kernel, (h2d, w), ...)`, where the
kernel reads `w` in its stored dtype and accumulates in fp32 (schedules/cpu/gemv.py, gemm.py), and removes
the then-unused astype/permute_dims bindings, so no fp32 copy of a weight ever exists.

Kernel choice per call: a static token count <= GEMV_MAX_ROWS (decode, and the batched decode variants of
import_relax: one row per sequence) -> GEMV specialised to that count, whose rows are each bit-identical to
the one-token GEMV on that row alone (gemv.py, gemv_quant.py: batch invariance);
a symbolic or larger count (prefill) -> GEMM with a symbolic token dimension (on AMX tiles for bf16 weights
when the target's features list amx_tile + amx_bf16, gemm_amx.py).

Weights stay in HF's row-major [N, K] layout: both kernels stream it as stored (the GEMV reaches the DRAM
ceiling on it, see benchmarks/bench_cpu_gemv.py), so no repacking is recorded in the bundle.

Decode fusion (schedules/cpu/gemv_fused.py): GEMV linears of one function that read the same x become one
kernel launch (q/k/v: one multi-output GEMV), and a gate/up pair consumed only as
`g * sigmoid(g) * u` becomes one GEMV that writes the SwiGLU product (the pair's outputs and the separate
elementwise pass disappear). Each fused linear still gets its own LoweredLinear entry.
Prefill fusion (gemm_amx.make_gemm_amx_multi): on an AMX target, up to three AMX GEMMs of one function that
read the same 2-D x become one launch with one output each (q/k/v; gate/up), so the activations are packed
once and the small k/v panels share the cores with q's instead of paying a packing pass and a fork/join of
their own. The AMX blocking of each launch comes from gemm_amx.blocking_for(summed N, K, dtype) (measured per
shape on the target), unless gemm_amx.BLOCKING_OVERRIDE is set (benchmarks comparing variants). The AMX
GEMMs take their activations at the build's `prefill_activations` precision (PREFILL_ACTIVATIONS): "model"
rounds them to bf16 for bf16 weights, as HF's bf16 linears do; "fp32" splits them into bf16 hi + lo (two tile
products, ~1e-5 of an fp32 GEMM). fp16 weights always split.

Quantized weights (`weight_types`: a GGUF file or `helmc build --quant`): the weight parameter becomes its raw
blocks, uint8 [N, row bytes] as the file stores them, and its linear calls the quantized kernels
(schedules/cpu/gemv_quant.py, quant/gemm.py): decode (a static count of tokens <= GEMV_MAX_ROWS: one token, or
one per sequence of a batched decode step) a GEMV that dequantizes in registers; other token counts one kernel that dequantizes the weight to an fp16 scratch and runs the fp16 GEMM's loop nest on it.
Quantized one-token decode linears on the int8 path (Q4_K / Q6_K on AVX-512) that read the same x with weights of
one type become one launch as the fp16 ones do (quant/gemv_int8_multi.py: x quantized once, every output the bits
of its own kernel); other quantized linears are not fused.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.utils import copy_with_new_vars

from helmc.schedules.cpu.gemm import make_gemm
from helmc.schedules.cpu import gemm_amx
from helmc.schedules.cpu.gemm_amx import AmxBlocking, amx_gemm_applies, make_gemm_amx, make_gemm_amx_multi
from helmc.schedules.cpu.gemv import GEMV_MAX_ROWS, make_gemv
from helmc.schedules.cpu.gemv_fused import MULTI_MAX_WEIGHTS, make_gemv_multi, make_gemv_swiglu
from helmc.compiler.passes.quantize_functions import raw_weight_params
from helmc.schedules.cpu.isa import VectorIsa, select_isa
from helmc.schedules.cpu.quant.gemm import make_gemm_quant
from helmc.model.weight_types import WEIGHT_TYPES
from helmc.schedules.cpu.quant.gemv_int8_multi import (QUANT_MULTI_MAX_WEIGHTS, make_gemv_quant_int8_multi,
                                                     quant_gemvs_fuse)
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


# Precision of the AMX prefill GEMM's activations (a build option, recorded in the bundle's manifest):
# "model": bf16 weights take bf16-rounded activations, as HF's bf16 model and torch's bf16 linear (one tile
#   product per step; against an fp32 GEMM of the unrounded activations that is bf16's rounding, ~2e-3);
# "fp32": activations split into bf16 hi + lo, two tile products per step (~1e-5 of an fp32 GEMM; the GEMM
#   takes 1.3-1.6x as long on a Sapphire Rapids Xeon).
PREFILL_ACTIVATIONS = ("model", "fp32")


def check_prefill_activations(value: str) -> None:
    if value not in PREFILL_ACTIVATIONS:
        from helmc.errors import HelmcError
        raise HelmcError(f"prefill activations: expected one of {PREFILL_ACTIVATIONS}, found {value!r}")


def lower_linear(mod: tvm.IRModule, features: tuple[str, ...], cores: int | None = None,
                 prefill_activations: str = "model", weight_types: dict | None = None) -> tvm.IRModule:
    """Every astype/permute_dims/matmul linear in every Relax function -> call_tir to a CPU kernel.
    `cores`: the target CPU's cores, the AMX prefill GEMM's parallel task count (default: its blocking's).
    `prefill_activations`: one of PREFILL_ACTIVATIONS (the AMX GEMM's activation precision).
    `weight_types`: {function name: {weight parameter name: quantized type}} (quantize_functions)."""
    return lower_linear_with_report(mod, features, cores, prefill_activations, weight_types)[0]


def lower_linear_with_report(mod: tvm.IRModule, features: tuple[str, ...], cores: int | None = None,
                             prefill_activations: str = "model", weight_types: dict | None = None,
                             ) -> tuple[tvm.IRModule, tuple[LoweredLinear, ...]]:
    check_prefill_activations(prefill_activations)
    rewriter = _LinearRewriter(mod, select_isa(features), cores, prefill_activations == "fp32")
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        rewriter.function_name = gvar.name_hint
        # Fresh variables per function: a decode variant made by binding `seq` in the prefill function
        # shares its parameter Vars, which Relax's FuseOps rejects ("appears at multiple definition sites").
        fresh = copy_with_new_vars(func)
        rewriter.quantized = raw_weight_params(fresh, (weight_types or {}).get(gvar.name_hint, {}))
        rewriter.plan = _plan_fusion(fresh, rewriter.isa, rewriter.quantized)
        new_func = relax.analysis.remove_all_unused(rewriter.visit_expr(fresh))
        if rewriter.quantized:
            # The float weight parameters are unused now (their astype/permute bindings went with the matmul):
            # the function takes the raw blocks in their place.
            params = [rewriter.quantized[p][1] if p in rewriter.quantized else p for p in fresh.params]
            leftover = [str(p.name) for p in rewriter.quantized if p in set(relax.analysis.free_vars(new_func.body))]
            assert not leftover, f"{gvar.name_hint}: quantized weights {leftover} are used other than by a linear"
            new_func = relax.Function(params, new_func.body, new_func.ret_ty, new_func.is_pure, new_func.attrs)
        rewriter.builder_.update_func(gvar, new_func)
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


def match_linear(call: relax.Call, resolve) -> tuple[relax.Expr, relax.Expr] | None:
    """(x, weight) when `call` is matmul(x, permute_dims(astype?(weight))) with a 2-D weight read as
    x @ weight.T, fp32 activations and a supported weight dtype; None leaves the call as it was."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.matmul":
        return None
    x, rhs = call.args
    transpose = resolve(rhs)
    if not (isinstance(transpose, relax.Call) and transpose.op.name == "relax.permute_dims"):
        return None
    axes = transpose.attrs.axes
    if axes is not None and [int(a) for a in axes] != [1, 0]:
        return None
    weight = transpose.args[0]
    widened = resolve(weight)
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



@dataclass(frozen=True)
class _FusedGroup:
    """Linears of one function fused into one kernel, emitted where the first of them was bound."""
    kind: str                         # "multi": one output per linear | "swiglu": one output, g*sigmoid(g)*u
                                      # | "amx_multi": prefill GEMMs on AMX, one output per linear
                                      # | "qmulti": one-token GEMVs of one int8-path quantized type (Q4_K,
                                      #   Q6_K, Q4_0: gemv_int8_multi.py), one output per linear
    x: relax.Var                      # the shared input, (m, K) fp32: static m <= GEMV_MAX_ROWS, or any
                                      # (symbolic) m for "amx_multi"
    linears: tuple[relax.Var, ...]    # bound to the matmuls, in binding order ("swiglu": gate, up)
    weights: tuple[relax.Expr, ...]   # each linear's weight as stored (the astype/permute stripped)
    out: relax.Var | None = None      # "swiglu": the var bound to the final multiply


@dataclass(frozen=True)
class _FusionPlan:
    groups: dict                      # first-bound var of a group -> _FusedGroup
    dropped: frozenset                # vars whose bindings the group replaces


def _plan_fusion(func: relax.Function, isa: VectorIsa, quantized: dict | None = None) -> _FusionPlan:
    """Find the decode GEMV linears that share x, gate/up pairs used only as g * sigmoid(g) * u, and the
    prefill linears on AMX that share x. Linears of `quantized` weights ({param: (type, raw param)}) share a
    launch only as one-token GEMVs of one type on the int8 path ("qmulti"); the others stay unfused."""
    quantized = quantized or {}
    if not isinstance(func.body, relax.SeqExpr):
        return _FusionPlan({}, frozenset())
    bindings = [b for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
    value_of = {b.var: b.value for b in bindings}
    uses: dict = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1

    for b in bindings:
        relax.analysis.post_order_visit(b.value, count)
    relax.analysis.post_order_visit(func.body.body, count)
    resolve = lambda e: value_of.get(e, e) if isinstance(e, relax.Var) else e  # noqa: E731
    by_x: dict = {}
    for b in bindings:
        if not (isinstance(b.value, relax.Call) and isinstance(b.var, relax.DataflowVar)):
            continue
        matched = match_linear(b.value, resolve)
        if matched is None or not isinstance(matched[0], relax.Var) or matched[0].ty.ndim != 2:
            continue
        m = _static_int(matched[0].ty.shape.values[0])
        dtype = _dtype_name(matched[1].ty)
        if matched[1] in quantized:
            qtype = quantized[matched[1]][0]
            k = _static_int(matched[0].ty.shape.values[1])
            if k is not None and quant_gemvs_fuse(qtype, isa, m, k):
                by_x.setdefault((matched[0], qtype, "qmulti"), []).append((b.var, matched[1]))
            continue
        if m is not None and m <= GEMV_MAX_ROWS:
            kind = "multi"
        else:
            n, k = (_static_int(d) for d in matched[1].ty.shape.values)
            if not amx_gemm_applies(n, k, dtype, isa):
                continue
            kind = "amx_multi"
        key = (matched[0], dtype, kind)
        by_x.setdefault(key, []).append((b.var, matched[1]))
    groups, dropped = {}, set()
    for (x, _, kind), members in by_x.items():
        if kind == "multi" and len(members) == 2:
            swiglu = _match_swiglu(members, bindings, uses)
            if swiglu is not None:
                (gate, wg), (up, wu), sig, gated, out = swiglu
                first = members[0][0]
                groups[first] = _FusedGroup("swiglu", x, (gate, up), (wg, wu), out)
                dropped |= {gate, up, sig, gated, out} - {first}
                continue
        most = QUANT_MULTI_MAX_WEIGHTS if kind == "qmulti" else MULTI_MAX_WEIGHTS
        for i in range(0, len(members) - 1, most):
            chunk = members[i:i + most]
            if len(chunk) < 2:
                continue
            groups[chunk[0][0]] = _FusedGroup(kind, x, tuple(v for v, _ in chunk), tuple(w for _, w in chunk))
            dropped |= {v for v, _ in chunk[1:]}
    return _FusionPlan(groups, frozenset(dropped))


def _match_swiglu(members, bindings, uses):
    """((gate, wg), (up, wu), sigmoid var, gate*sigmoid var, output var) when the pair is used exactly as
    out = (g * sigmoid(g)) * u (either operand order), every intermediate used once; else None."""
    def call_of(var, op):
        for b in bindings:
            if b.var.same_as(var):
                v = b.value
                return v if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == op else None
        return None

    def users(var, op):
        return [b for b in bindings if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
                and b.value.op.name == op and any(a.same_as(var) for a in b.value.args)]

    for (g, wg), (u, wu) in (tuple(members), tuple(reversed(members))):
        sig = [b for b in users(g, "relax.sigmoid")]
        if len(sig) != 1 or uses.get(g) != 2 or uses.get(u) != 1 or uses.get(sig[0].var) != 1:
            continue
        gated = [b for b in users(sig[0].var, "relax.multiply") if any(a.same_as(g) for a in b.value.args)]
        if len(gated) != 1 or uses.get(gated[0].var) != 1:
            continue
        out = [b for b in users(gated[0].var, "relax.multiply") if any(a.same_as(u) for a in b.value.args)]
        if len(out) != 1 or not isinstance(out[0].var, relax.DataflowVar):
            continue
        if g.ty.shape is None or any(_static_int(a) != _static_int(b)
                                     for a, b in zip(g.ty.shape.values, out[0].var.ty.shape.values)):
            continue
        return (g, wg), (u, wu), sig[0].var, gated[0].var, out[0].var
    return None


@mutator
class _LinearRewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, isa: VectorIsa, cores: int | None, split_activations: bool):
        super().__init__(mod)
        self.isa = isa
        self.cores = cores
        self.split_activations = split_activations
        self.kernels: dict[tuple, relax.GlobalVar] = {}
        self.lowered: list[LoweredLinear] = []
        self.function_name = ""
        self.plan = _FusionPlan({}, frozenset())
        self.quantized: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: N802 (TVM's visitor name)
        if binding.var in self.plan.dropped:
            return
        group = self.plan.groups.get(binding.var)
        if group is None:
            super().visit_var_binding_(binding)
            return
        self._emit_fused_group(group)

    def _emit_fused_group(self, group: _FusedGroup) -> None:
        x = self.visit_expr(group.x)
        weights = [self.visit_expr(w) for w in group.weights]
        m, k = x.ty.shape.values[0], int(x.ty.shape.values[1])
        dtype = _dtype_name(weights[0].ty)
        ns = tuple(int(w.ty.shape.values[0]) for w in weights)
        if group.kind == "qmulti":                 # the raw blocks replace the float weights (as _emit_quantized)
            dtype = self.quantized[group.weights[0]][0]
            weights = [self.quantized[w][1] for w in group.weights]
            key = ("gemv_quant_multi", dtype, ns, k)
            make = lambda: make_gemv_quant_int8_multi(dtype, ns, k, self.isa)  # noqa: E731
            out_ty = [relax.TensorType([1, n], "float32") for n in ns]
        elif group.kind == "amx_multi":
            key = ("gemm_amx_multi", ns, k, dtype)
            make = lambda: make_gemm_amx_multi(ns, k, dtype, blocking=self._amx_blocking(sum(ns), k, dtype),  # noqa: E731
                                               split_activations=self._amx_split(dtype))
            out_ty = [relax.TensorType([m, n], "float32") for n in ns]
        elif group.kind == "swiglu":
            m = int(m)
            key = ("swiglu", m, ns[0], k, dtype)
            make = lambda: make_gemv_swiglu(m, ns[0], k, dtype, self.isa)  # noqa: E731
            out_ty = relax.TensorType([m, ns[0]], "float32")
        else:
            m = int(m)
            key = ("multi", m, ns, k, dtype)
            make = lambda: make_gemv_multi(m, ns, k, dtype, self.isa)  # noqa: E731
            out_ty = [relax.TensorType([m, n], "float32") for n in ns]
        if key not in self.kernels:
            prim = make()
            self.kernels[key] = self.builder_.add_func(prim, str(prim.attrs["global_symbol"]))
        gvar = self.kernels[key]
        result = self.builder_.emit(relax.call_tir(gvar, [x] + weights, out_ty))
        for n in ns:
            self.lowered.append(LoweredLinear(self.function_name, gvar.name_hint, str(x.ty.shape.values[0]), n, k, dtype))
        if group.kind == "swiglu":
            self.set_var_remap(group.out, result)
            return
        for i, var in enumerate(group.linears):
            self.set_var_remap(var, self.builder_.emit(relax.TupleGetItem(result, i)))

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        matched = self._match_linear(call)
        if matched is None:
            return call
        x, weight = matched
        return self._emit_kernel_call(x, weight)

    def _amx_blocking(self, n: int, k: int, dtype: str) -> AmxBlocking:
        """gemm_amx's measured per-shape blocking, or its BLOCKING_OVERRIDE (read when called: benchmarks
        may set it), with one task per core."""
        blocking = gemm_amx.BLOCKING_OVERRIDE or gemm_amx.blocking_for(n, k, dtype)
        return blocking if self.cores is None else dataclasses.replace(blocking, tasks=self.cores)

    def _amx_split(self, dtype: str) -> bool | None:
        """True for "fp32" prefill activations with bf16 weights, else None (the model's precision; fp16
        weights always split)."""
        return True if self.split_activations and dtype == "bfloat16" else None

    def _resolve(self, expr: relax.Expr) -> relax.Expr:
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                return bound
        return expr

    def _match_linear(self, call: relax.Call) -> tuple[relax.Expr, relax.Expr] | None:
        return match_linear(call, self._resolve)

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
        if weight in self.quantized:
            out = self._emit_quantized(x2d, static_tokens, tokens, n, k, *self.quantized[weight])
        else:
            out, gvar = self._emit_float(x2d, static_tokens, tokens, n, k, weight, dtype)
            self.lowered.append(LoweredLinear(self.function_name, gvar.name_hint, str(tokens), n, k, dtype))
        if len(x_dims) != 2:
            out = self.builder_.emit(out)
            return relax.op.reshape(out, relax.ShapeExpr(tokens_dims + [n]))  # (T, N) -> (..., N)
        return out

    def _kernel(self, key: tuple, make) -> relax.GlobalVar:
        if key not in self.kernels:
            prim = make()
            self.kernels[key] = self.builder_.add_func(prim, str(prim.attrs["global_symbol"]))
        return self.kernels[key]

    def _emit_quantized(self, x2d, static_tokens, tokens, n: int, k: int, qtype: str, blocks: relax.Var):
        if static_tokens is not None and static_tokens <= GEMV_MAX_ROWS:
            m = static_tokens
            gvar = self._kernel(("gemv_quant", qtype, m, n, k), lambda: WEIGHT_TYPES[qtype].maker("cpu_gemv")(
                qtype, n, k, self.isa, m=m))
            out = relax.call_tir(gvar, [x2d, blocks], relax.TensorType([m, n], "float32"))
        else:
            gvar = self._kernel(("gemm_quant", qtype, n, k), lambda: make_gemm_quant(qtype, n, k, self.isa))
            out = relax.call_tir(gvar, [x2d, blocks], relax.TensorType([tokens, n], "float32"))
        self.lowered.append(LoweredLinear(self.function_name, gvar.name_hint, str(tokens), n, k, qtype))
        return out

    def _emit_float(self, x2d, static_tokens, tokens, n: int, k: int, weight, dtype: str):
        if static_tokens is not None and static_tokens <= GEMV_MAX_ROWS:
            key = ("gemv", static_tokens, n, k, dtype)
            make = lambda: make_gemv(static_tokens, n, k, dtype, self.isa)  # noqa: E731
        else:
            key = ("gemm", n, k, dtype)
            make = lambda: make_gemm(n, k, dtype, self.isa)  # noqa: E731
            if amx_gemm_applies(n, k, dtype, self.isa):
                key = ("gemm_amx", n, k, dtype)
                make = lambda: make_gemm_amx(n, k, dtype, blocking=self._amx_blocking(n, k, dtype),  # noqa: E731
                                             split_activations=self._amx_split(dtype))
        gvar = self._kernel(key, make)
        return relax.call_tir(gvar, [x2d, weight], relax.TensorType([tokens, n], "float32")), gvar
