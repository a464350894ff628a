"""Relax pass: the GPU stage's decode linears over fp16 / bf16 weights -> helmc's own GEMV (schedules/gpu/gemv.py).

In every decode function -- `decode` (one row) and the batched `decode_b{B}` variants (import_relax: B rows, one
per sequence), of every weight signature -- a linear
    y = matmul(x, permute_dims(astype?(w)))        x: [m, K] fp16, w: [N, K] fp16 / bf16, m <= gemv.MAX_ROWS
becomes `call_tir(make_gpu_gemv(m, N, K, dtype(w)), [x, w])`: w read as stored, fp32 sums, y rounded to fp16
once, as the matmul computed before (compile_gpu_stage.rewrite_matmuls_fp32_accumulate). The kernel forms every
row of y the same way whatever m is, so a batched decode step gives each sequence the bits of its own decode
step (batch invariance), which dlight's GEMV (m = 1) and LowBatchGEMV (m > 1) schedules did not promise. fp32 weights
keep their cast to fp16 (the kernel reads the cast copy, as the matmul did).
Runs after lower_quantized_gpu (quantized weights are raw blocks by then, with their own m-row GEMV) and
before rewrite_matmuls_fp32_accumulate, which then sees only the prefill matmuls; a linear this pass does not
take (K not a multiple of 8, activations other than fp16) is left to dlight as before.

Fewer launches per decode step (a CUDA graph node costs ~1 us beside its work), every output
bit-identical to the separate kernels' (schedules/gpu/gemv.py's one-launch forms):
- SwiGLU: silu(x @ wg^T) * (x @ wu^T) -- sigmoid, multiply, multiply over the gate and up GEMVs -- is one launch
  over both weights with the elementwise part as its epilogue;
- the block's last residual add, r + x @ w^T whose sum is only returned (down_proj): one launch. An add whose sum
  is used further (o_proj's) is left for fuse_gpu_norms' add + RMSNorm kernel;
- the GEMVs left that read one x (q, k, v) become one launch (one_launch_per_shared_x, which lower_quantized_gpu
  uses for its int8 GEMVs too).
"""
from __future__ import annotations

import re
from itertools import permutations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from helmc.schedules.gpu.gemv import MAX_ROWS, VEC, WEIGHT_DTYPES, make_gpu_gemv

DECODE = re.compile(r"_decode(_b\d+)?(_t\d+)?$")     # runtime.stage.block_function_name's decode functions


def lower_decode_gemv(mod: tvm.IRModule, fuse: bool = True) -> tvm.IRModule:
    """fuse=False: one launch per linear (the reference the one-launch forms are held to)."""
    rewriter = _DecodeLinears(mod)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and DECODE.search(gvar.name_hint):
            body = rewriter.visit_expr(func.body)
            new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
            rewriter.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
    mod = rewriter.builder_.get()
    if not fuse:
        return mod
    gemvs = {gvar.name_hint: ((m, k, dtype), n) for (m, n, k, dtype), gvar in rewriter.kernels.items()}
    mod = fuse_gemv_epilogues(mod, gemvs, lambda kind, n, epilogue: make_gpu_gemv(
        kind[0], n, kind[1], kind[2], epilogue=epilogue))
    return one_launch_per_shared_x(mod, gemvs, lambda kind, ns: make_gpu_gemv(kind[0], ns, kind[1], kind[2]))


MAX_SHARED_X = 3      # weights one GEMV launch takes (q, k, v)
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _gemv_call(value, gemvs: dict):
    """(kernel name, x, weight) of a call_tir of one of `gemvs`' one-weight GEMVs, or None."""
    if isinstance(value, relax.Call) and value.op == _CALL_TIR and isinstance(value.args[0], relax.GlobalVar) \
            and value.args[0].name_hint in gemvs and len(value.args[1].fields) == 2:
        return value.args[0].name_hint, value.args[1].fields[0], value.args[1].fields[1]
    return None


def rewrite_decode_blocks(mod: tvm.IRModule, rewrite_block) -> tvm.IRModule:
    """Every decode function's blocks through rewrite_block(builder, function, block) -> block (the same object when
    nothing changed); PrimFuncs it adds through the builder come with the module returned."""
    bb = relax.BlockBuilder(mod)
    updated = {}
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or not DECODE.search(gvar.name_hint):
            continue
        blocks = [rewrite_block(bb, func, block) for block in func.body.blocks]
        if any(new is not old for new, old in zip(blocks, func.body.blocks)):
            new = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                                 func.attrs)
            updated[gvar] = relax.analysis.remove_all_unused(new)
    out = bb.get()              # the new kernels added; the functions replaced after (no builder dedup of them)
    for gvar, func in updated.items():
        out[gvar] = func
    return relax.transform.Normalize()(out)     # struct info of the new calls (later passes' builders need it)


def with_bindings(block, bindings: list):
    return relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(bindings)


def local_var(block, name: str, ty):
    """A new var for a binding inside `block` (a dataflow block's own vars are DataflowVars)."""
    return (relax.DataflowVar if isinstance(block, relax.DataflowBlock) else relax.Var)(name, ty)


def one_launch_per_shared_x(mod: tvm.IRModule, gemvs: dict, make) -> tvm.IRModule:
    """In every decode function, the GEMVs of one x and kind (q, k, v; gate, up) become one launch over up to
    MAX_SHARED_X weights, placed where the first of them was: two to three graph nodes go, and the small k / v
    projections ride on q's launch. gemvs: {kernel name: (kind, row count)} of the one-weight GEMVs that may join
    (one kind: the same kernel but for the row count -- weight type, m, k, tuning); make(kind, row counts) -> the
    PrimFunc over those weights, each output bit-identical to its one-weight kernel's, so tokens do not change."""
    def rewrite_block(bb, _func, block):
        bindings = list(block.bindings)
        bound_at = {b.var: i for i, b in enumerate(bindings)}
        groups: dict[tuple, list[int]] = {}
        for i, b in enumerate(bindings):
            found = _gemv_call(b.value, gemvs)
            if found:
                name, x, w = found
                first = groups.get((x, gemvs[name][0]), [i])[0]
                if bound_at.get(w, -1) < first:      # an fp32 weight's cast bound after the first GEMV cannot join
                    groups.setdefault((x, gemvs[name][0]), []).append(i)
        out, skip = {}, set()
        for (x, kind), idx in groups.items():
            for part in (idx[j:j + MAX_SHARED_X] for j in range(0, len(idx), MAX_SHARED_X)):
                if len(part) < 2:
                    continue
                calls = [_gemv_call(bindings[i].value, gemvs) for i in part]
                ns = tuple(gemvs[name][1] for name, _, _ in calls)
                prim = make(kind, ns)
                fused = bb.add_func(prim, str(prim.attrs["global_symbol"]))
                outs = [bindings[i].value.ty for i in part]
                tv = local_var(block, f"gemv_x{part[0]}", relax.TupleType(outs))
                call = relax.call_tir(fused, [x] + [w for _, _, w in calls], outs)
                out[part[0]] = [relax.VarBinding(tv, call)] + [
                    relax.VarBinding(bindings[i].var, relax.TupleGetItem(tv, j)) for j, i in enumerate(part)]
                skip.update(part[1:])
        if not out:
            return block
        new = []
        for i, b in enumerate(bindings):
            new += out.get(i, [] if i in skip else [b])
        return with_bindings(block, new)

    return rewrite_decode_blocks(mod, rewrite_block)


def _users(func: relax.Function) -> dict:
    """var -> how many bindings of func use it, plus one where func's result does."""
    count: dict = {}
    exprs = [b.value for block in func.body.blocks for b in block.bindings] + [func.body.body]
    for expr in exprs:
        for v in relax.analysis.free_vars(expr):
            count[v] = count.get(v, 0) + 1
    return count


def fuse_gemv_epilogues(mod: tvm.IRModule, gemvs: dict, make) -> tvm.IRModule:
    """SwiGLU over the gate and up GEMVs, and a residual add whose sum is only returned, as one GEMV launch each
    (the epilogues of make_gpu_gemv and make_gpu_gemv_int8; module docstring). gemvs: {kernel name: (kind, rows)}
    of one-weight GEMVs (kind: what the kernel is but for its row count); make(kind, rows, epilogue) -> the
    PrimFunc with that epilogue, its output the bits of the GEMVs and the elementwise kernels run apart."""
    multiply, add, sigmoid = (tvm.ir.Op.get(f"relax.{op}") for op in ("multiply", "add", "sigmoid"))

    def rewrite_block(bb, func, block):
        bindings = list(block.bindings)
        value = {b.var: b.value for b in bindings}
        users = _users(func)
        result = set(relax.analysis.free_vars(func.body.body))

        def op_of(var, op):
            v = value.get(var)
            return v if isinstance(v, relax.Call) and v.op == op else None

        def swiglu(b):
            """(kind, rows, x, wg, wu) of b = multiply(multiply(g, sigmoid(g)), u) over GEMVs g, u of one x."""
            for a, u in permutations(op_of(b.var, multiply).args):
                act, up = op_of(a, multiply), _gemv_call(value.get(u), gemvs)
                for g, s in permutations(act.args) if act is not None and up is not None else ():
                    gate, sig = _gemv_call(value.get(g), gemvs), op_of(s, sigmoid)
                    if gate and sig is not None and sig.args[0].same_as(g) and gate[1].same_as(up[1]) \
                            and gemvs[gate[0]] == gemvs[up[0]] and users.get(g) == 2 \
                            and all(users.get(v) == 1 for v in (s, a, u)):
                        return (*gemvs[gate[0]], gate[1], gate[2], up[2])
            return None

        def residual(b):
            """(kind, rows, x, w, r) of b = add(r, GEMV y) (either order) whose sum is only returned."""
            if users.get(b.var) != 1 or b.var not in result:
                return None
            for y, r in permutations(op_of(b.var, add).args):
                down = _gemv_call(value.get(y), gemvs)
                if down and users.get(y) == 1 and _static_shape(r) == _static_shape(y) and str(r.ty.dtype) == "float16":
                    return (*gemvs[down[0]], down[1], down[2], r)
            return None

        new, changed = [], False
        for b in bindings:
            fused = None
            if op_of(b.var, multiply) is not None and (found := swiglu(b)):
                kind, n, x, wg, wu = found
                fused = (make(kind, n, "swiglu"), [x, wg, wu])
            elif op_of(b.var, add) is not None and (found := residual(b)):
                kind, n, x, w, r = found
                fused = (make(kind, n, "residual"), [x, w, r])
            if fused is None:
                new.append(b)
                continue
            gvar = bb.add_func(fused[0], str(fused[0].attrs["global_symbol"]))
            new.append(relax.VarBinding(b.var, relax.call_tir(gvar, fused[1], b.value.ty)))
            changed = True      # the GEMVs and elementwise ops it replaces are unused now: remove_all_unused
        return with_bindings(block, new) if changed else block

    return rewrite_decode_blocks(mod, rewrite_block)


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
