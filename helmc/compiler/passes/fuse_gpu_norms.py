"""Relax pass: the GPU stage's RMSNorms, residual adds and RoPE as one hand-scheduled kernel each.

The exported block spells RMSNorm as ten Relax ops (astype, x*x, mean, +eps, sqrt, 1/., astype(w), two
multiplies, astype back), the q/k norm + RoPE as twenty more, and the residual add as its own op before the
norm that reads it. TVM's FuseOps leaves these in ~20 kernels per layer (the cast that two consumers read and
the square ahead of the reduction stay apart), each a few microseconds in a decode step whose GEMVs take
tens: a per-kernel table of the all-GPU Qwen3-8B Q4_K step put ~2 ms of 6.4 in them. This pass
finds the three graphs in every function with static shapes (the decode variants) and calls
schedules/gpu/norm_rope.py's kernels, which compute the same ops in the same precisions:

  rms_norm       astype(w*(xf * 1/sqrt(mean(xf*xf) + eps)), f16), xf = astype(x, f32)  -> rms_norm(x, w)
  add_rms_norm   s = add(a, b) (fp16) whose rms_norm is taken          -> (s, rms_norm(s, w)) in one kernel
  rms_norm_rope  q16*c16 + concat(-q16[..., D/2:], q16[..., :D/2])*s16, q16 an rms_norm of [S, heads, D],
                 c16/s16 = astype(expand_dims(cos|sin, 1), f16)         -> rms_norm_rope(x, w, cos, sin)

A graph that does not match exactly (other ops, other axes, symbolic shapes) is left to TVM. In the decode
functions the q and k norm + RoPE of one cos / sin then become one launch (a CUDA graph node costs
~1 us beside its work; each output bit-identical to its own launch's). Runs after lower_quantized_gpu and the
fp32-accumulation rewrite, before legalization.

fuse_norm_gemv (below, run after this pass): the decode RMSNorms then go into the GEMVs that read them.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from helmc.compiler.passes.lower_decode_gemv import _users, local_var, rewrite_decode_blocks, with_bindings
from helmc.schedules.gpu.gemv import make_gpu_gemv, parse_gemv_symbol
from helmc.schedules.gpu.norm_rope import make_rms_norm, make_rms_norm_rope

_BIG = 2 ** 62          # a slice's "to the end" bound as the ONNX import spells it (INT64_MAX)


def fuse_gpu_norms(mod: tvm.IRModule, one_launch_qk: bool = True) -> tvm.IRModule:
    fuser = _Fuser(mod)
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function):
            continue
        fuser.analyze(func)
        if not fuser.rms:
            continue
        new = relax.analysis.remove_all_unused(fuser.visit_expr(func))
        fuser.builder_.update_func(gvar, new)
    if not one_launch_qk:
        return fuser.builder_.get()
    ropes = {gvar.name_hint: key for key, gvar in fuser.kernels.items() if key[0] == "rms_norm_rope"}
    return _q_and_k_rope_in_one_launch(fuser.builder_.get(), ropes)


def _q_and_k_rope_in_one_launch(mod: tvm.IRModule, ropes: dict) -> tvm.IRModule:
    """Two rms_norm_rope calls of one cos, sin and eps in a decode function's block (q's and k's) as one
    make_rms_norm_rope(q, eps, shape_k=k) launch where the first was. ropes: {kernel name: its kernels key}."""
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def rope_of(value):
        if isinstance(value, relax.Call) and value.op == call_tir and isinstance(value.args[0], relax.GlobalVar):
            return ropes.get(value.args[0].name_hint)
        return None

    def rewrite_block(bb, _func, block):
        bindings = list(block.bindings)
        bound_at = {b.var: i for i, b in enumerate(bindings)}
        groups: dict[tuple, list[int]] = {}
        for i, b in enumerate(bindings):
            if (key := rope_of(b.value)) is not None:
                x, _, cos, sin = b.value.args[1].fields
                first = groups.get((cos, sin, key[2]), [i])[0]
                if bound_at.get(x, -1) < first:      # k's input must be there at q's launch
                    groups.setdefault((cos, sin, key[2]), []).append(i)
        out, skip = {}, set()
        for (cos, sin, eps), idx in groups.items():
            if len(idx) < 2:
                continue
            i, j = idx[:2]
            (xq, wq, *_), (xk, wk, *_) = bindings[i].value.args[1].fields, bindings[j].value.args[1].fields
            prim = make_rms_norm_rope(rope_of(bindings[i].value)[1], eps, shape_k=rope_of(bindings[j].value)[1])
            gvar = bb.add_func(prim, str(prim.attrs["global_symbol"]))
            outs = [bindings[i].value.ty, bindings[j].value.ty]
            both = local_var(block, f"rope_qk{i}", relax.TupleType(outs))
            out[i] = [relax.VarBinding(both, relax.call_tir(gvar, [xq, wq, xk, wk, cos, sin], outs)),
                      relax.VarBinding(bindings[i].var, relax.TupleGetItem(both, 0)),
                      relax.VarBinding(bindings[j].var, relax.TupleGetItem(both, 1))]
            skip.add(j)
        if not out:
            return block
        return with_bindings(block, [n for k, b in enumerate(bindings) for n in out.get(k, [] if k in skip else [b])])

    return rewrite_decode_blocks(mod, rewrite_block)


def _op(name: str):
    return tvm.ir.Op.get(f"relax.{name}")


def _static_shape(expr) -> tuple | None:
    """The shape with int dims, the first one possibly a symbolic token count (its tirx.Var, the same object
    wherever the function uses it), or None for anything else."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    dims = []
    for i, d in enumerate(shape.values):
        if isinstance(d, (int, tvm.tirx.IntImm)):
            dims.append(int(d))
        elif i == 0 and isinstance(d, tvm.tirx.Var):
            dims.append(d)
        else:
            return None
    return tuple(dims)


def _same(a, b) -> bool:
    """Shape equality that compares symbolic dims by identity (== on a tirx.Var builds an expression)."""
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) != isinstance(y, int) or (x != y if isinstance(x, int) else not x.same_as(y)):
            return False
    return True


def _dtype(expr) -> str:
    return str(getattr(expr.ty, "dtype", ""))


def _scalar(expr) -> float | None:
    if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def _ints(expr) -> list[int]:
    """The integers of a Relax tuple of PrimValues (or a shape)."""
    items = expr.fields if isinstance(expr, relax.Tuple) else expr.values
    return [int(getattr(v, "value", v)) for v in items]


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.kernels: dict = {}

    # -------------------------------------------------------------- matching
    def analyze(self, func: relax.Function) -> None:
        """Find the graphs in func: rms {out var: (x, w, eps)}, add_rms {sum var: (a, b, out var)},
        rope {result var: (x, w, eps, cos, sin)}."""
        self.bound = {b.var: b.value for blk in func.body.blocks for b in blk.bindings
                      if isinstance(b, relax.VarBinding)}
        self.rms, self.add_rms, self.rope, self.pending = {}, {}, {}, {}
        for var in self.bound:
            found = self._match_rms(var)
            if found:
                self.rms[var] = found
        for out, (x, w, eps) in self.rms.items():
            add = self._call(x, "add")
            if add is not None and _dtype(x) == "float16" and x not in self.add_rms and \
                    all(_same(_static_shape(a), _static_shape(x)) and _dtype(a) == "float16" for a in add.args):
                self.add_rms[x] = (add.args[0], add.args[1], out)
        for var in self.bound:
            found = self._match_rope(var)
            if found:
                self.rope[var] = found

    def _call(self, expr, op: str):
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        return value if isinstance(value, relax.Call) and value.op == _op(op) else None

    def _astype_of(self, expr, dtype: str):
        """The input of astype(input, dtype) bound to expr, or None."""
        c = self._call(expr, "astype")
        return c.args[0] if c is not None and str(c.attrs.dtype) == dtype else None

    def _match_rms(self, out):
        y = self._astype_of(out, "float16")
        mul = self._call(y, "multiply") if y is not None else None
        if mul is None:
            return None
        for wf, n in (mul.args, mul.args[::-1]):
            w = self._astype_of(wf, "float32")
            norm = self._call(n, "multiply")
            if w is None or norm is None or _dtype(w) != "float16" or len(_static_shape(w) or ()) != 1:
                continue
            for xf, inv in (norm.args, norm.args[::-1]):
                x = self._astype_of(xf, "float32")
                eps = self._inverse_rms_eps(inv, xf)
                shape = _static_shape(out)
                if x is not None and eps is not None and _dtype(x) == "float16" and shape and len(shape) >= 2 \
                        and _same(_static_shape(x), shape) and _same(_static_shape(w), (shape[-1],)):
                    return x, w, eps
        return None

    def _inverse_rms_eps(self, inv, xf) -> float | None:
        """eps if inv = 1 / sqrt(mean(xf * xf, axis=-1, keepdims) + eps), else None."""
        div = self._call(inv, "divide")
        if div is None or _scalar(div.args[0]) != 1.0:
            return None
        sqrt = self._call(div.args[1], "sqrt")
        add = self._call(sqrt.args[0], "add") if sqrt is not None else None
        if add is None:
            return None
        mean = self._call(add.args[0], "mean")
        eps = _scalar(add.args[1])
        if mean is None or eps is None or not mean.attrs.keepdims:
            return None
        rank = int(getattr(xf.ty, "ndim", -1))
        if rank < 1 or [int(a) % rank for a in mean.attrs.axis] != [rank - 1]:
            return None
        sq = self._call(mean.args[0], "multiply")
        return eps if sq is not None and sq.args[0].same_as(xf) and sq.args[1].same_as(xf) else None

    def _cos_sin(self, expr):
        """The f32 [S, D] table under astype(expand_dims(table, axis=[1]), f16), or None."""
        e = self._astype_of(expr, "float16")
        ex = self._call(e, "expand_dims") if e is not None else None
        if ex is None or [int(a) for a in ex.attrs.axis] != [1] or _dtype(ex.args[0]) != "float32":
            return None
        return ex.args[0]

    def _slice(self, expr, q, begin: int, end: int) -> bool:
        s = self._call(expr, "strided_slice")
        if s is None or not s.args[0].same_as(q):
            return False
        axes, begins, ends = (_ints(s.args[i]) for i in (1, 2, 3))
        strides = _ints(s.args[4]) if len(s.args) > 4 else [1]
        rank = len(_static_shape(q) or ())
        return rank > 0 and [a % rank for a in axes] == [rank - 1] and begins == [begin] and strides == [1] and \
            (ends[0] == end or (end == _static_shape(q)[-1] and ends[0] >= _BIG))

    def _match_rope(self, var):
        add = self._call(var, "add")
        if add is None:
            return None
        for m1, m2 in (add.args, add.args[::-1]):
            p1, p2 = self._call(m1, "multiply"), self._call(m2, "multiply")
            if p1 is None or p2 is None:
                continue
            for q, c16 in (p1.args, p1.args[::-1]):
                if q not in self.rms or _static_shape(q) is None or len(_static_shape(q)) != 3:
                    continue
                cos = self._cos_sin(c16)
                for cat, s16 in (p2.args, p2.args[::-1]):
                    sin = self._cos_sin(s16)
                    concat = self._call(cat, "concat")
                    if cos is None or sin is None or concat is None or len(concat.args[0].fields) != 2:
                        continue
                    neg, lo = concat.args[0].fields
                    neg_in = self._call(neg, "negative")
                    d = _static_shape(q)[-1]
                    if neg_in is not None and self._slice(neg_in.args[0], q, d // 2, d) and \
                            self._slice(lo, q, 0, d // 2) and \
                            _same(_static_shape(cos), (_static_shape(q)[0], d)) and _same(_static_shape(sin), (_static_shape(q)[0], d)):
                        x, w, eps = self.rms[q]
                        return x, w, eps, cos, sin
        return None

    # -------------------------------------------------------------- rewriting
    def _kernel(self, key: tuple, make) -> relax.GlobalVar:
        if key not in self.kernels:
            prim = make()
            self.kernels[key] = self.builder_.add_func(prim, str(prim.attrs["global_symbol"]))
        return self.kernels[key]

    def _rebind(self, var, value) -> None:
        """var = value in the block being built (the same var: later uses need no remapping)."""
        self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(value)))

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:  # noqa: N802 (TVM's visitor name)
        var = binding.var
        if var in self.add_rms:
            a, b, out = self.add_rms[var]
            _, w, eps = self.rms[out]
            shape = _static_shape(var)
            gvar = self._kernel(("add_rms_norm", shape, eps), lambda: make_rms_norm(shape, eps, add=True))
            ty = relax.TensorType(list(shape), "float16")
            both = self.builder_.emit(relax.call_tir(gvar, [self.visit_expr(a), self.visit_expr(b), w],
                                                     [ty, ty]))
            self.pending[out] = both
            self._rebind(var, relax.TupleGetItem(both, 0))
        elif var in self.pending:
            self._rebind(var, relax.TupleGetItem(self.pending.pop(var), 1))
        elif var in self.rope:
            x, w, eps, cos, sin = self.rope[var]
            shape = _static_shape(var)
            gvar = self._kernel(("rms_norm_rope", shape, eps), lambda: make_rms_norm_rope(shape, eps))
            call = relax.call_tir(gvar, [self.visit_expr(x), w, self.visit_expr(cos), self.visit_expr(sin)],
                                  relax.TensorType(list(shape), "float16"))
            self._rebind(var, call)
        elif var in self.rms:
            x, w, eps = self.rms[var]
            shape = _static_shape(var)
            gvar = self._kernel(("rms_norm", shape, eps), lambda: make_rms_norm(shape, eps))
            call = relax.call_tir(gvar, [self.visit_expr(x), w], relax.TensorType(list(shape), "float16"))
            self._rebind(var, call)
        else:
            super().visit_var_binding_(binding)


# ---------------------------------------------------------------------------------------------- fuse_norm_gemv
# Relax pass: a decode step's RMSNorm folded into the fp16 / bf16 GEMVs that read its output (one launch fewer each).
#
# After fuse_gpu_norms a decode layer still launches two norm kernels ahead of its GEMVs, each one thread block
# over one row of 4096 values (~4 us of latency in a 4.5 ms Qwen3-8B step, 72 of them), while the GEMV's blocks
# read all of that row anyway. schedules/gpu/gemv.py's norm prologue takes the norm's input and weight instead
# and scales its sums by 1 / sqrt(mean(x^2) + eps). In every decode function:
#
#   y = rms_norm(x, g); GEMVs of y          -> GEMVs of (x, g) with the prologue
#   (s, y) = add_rms_norm(a, b, g), a = one-weight GEMV(x_o, w_o) read only here; GEMVs of y
#                                           -> s = the residual-epilogue GEMV(x_o, w_o, b) (bit-identical s: the
#                                              same rounded product and fp16 add), GEMVs of (s, g) with the prologue
#
# where "GEMVs of y" is every use of y, each a gemv.py kernel with y as its x (one weight, q/k/v's shared-x launch,
# or the SwiGLU pair) and no residual epilogue. Anything else is left as it was (the int8 GEMVs of quantized
# weights, prefill). The normed row is no longer rounded to fp16 before the products: outputs move within fp16
# rounding, not bit for bit; a batched step's rows are still each sequence's one-row bits (the prologue is per row).
# Runs after fuse_gpu_norms (whose kernels carry their eps as the attribute helmc_eps).
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _kernel(value) -> str | None:
    if isinstance(value, relax.Call) and value.op == _CALL_TIR and isinstance(value.args[0], relax.GlobalVar):
        return value.args[0].name_hint
    return None


def _gemv_of(name: str | None):
    """parse_gemv_symbol of a gemv.py kernel the prologue can join (no residual epilogue), else None."""
    found = parse_gemv_symbol(name or "")
    return found if found and found[5] != "residual" else None


def fuse_norm_gemv(mod: tvm.IRModule) -> tvm.IRModule:
    eps_of = {gv.name_hint: float(f.attrs["helmc_eps"]) for gv, f in mod.functions_items()
              if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "helmc_eps" in f.attrs}

    def rewrite_block(bb, func, block):
        bindings = list(block.bindings)
        value = {b.var: b.value for b in bindings}
        users = _users(func)
        readers: dict = {}                    # var -> indices of the bindings whose value reads it
        for i, b in enumerate(bindings):
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, []).append(i)
        result = set(relax.analysis.free_vars(func.body.body))

        def gemvs_of(y) -> list[int] | None:
            """The bindings of y's every use when each is a prologue-able GEMV with y as its x, else None."""
            idx = readers.get(y, [])
            if not idx or y in result or users.get(y) != len(idx):
                return None
            ok = all(_gemv_of(_kernel(bindings[i].value)) and bindings[i].value.args[1].fields[0].same_as(y)
                     and sum(f.same_as(y) for f in bindings[i].value.args[1].fields) == 1 for i in idx)
            return idx if ok else None

        def with_prologue(i, x, g, eps):
            call = bindings[i].value
            m, n, k, dtype, tuning, epilogue = _gemv_of(_kernel(call))
            prim = make_gpu_gemv(m, n, k, dtype, tuning, epilogue, norm_eps=eps)
            gvar = bb.add_func(prim, str(prim.attrs["global_symbol"]))
            out = call.ty_args[0]
            out = list(out.fields) if isinstance(out, relax.TupleType) else out
            return relax.VarBinding(bindings[i].var, relax.call_tir(gvar, [x, g, *call.args[1].fields[1:]], out))

        new = dict(enumerate(bindings))
        changed = False
        for i, b in enumerate(bindings):
            name = _kernel(b.value)
            if name is None or name not in eps_of:
                continue
            eps, args = eps_of[name], list(b.value.args[1].fields)
            if name.startswith("helmc_gpu_rms_norm_") and len(args) == 2:
                idx = gemvs_of(b.var)
                if idx is None:
                    continue
                for j in idx:
                    new[j] = with_prologue(j, args[0], args[1], eps)
                changed = True
            elif name.startswith("helmc_gpu_add_rms_norm_") and len(args) == 3:
                # t = add_rms_norm(a, b, g); s = t[0]; y = t[1]
                gets = {bindings[j].value.index: j for j in readers.get(b.var, [])
                        if isinstance(bindings[j].value, relax.TupleGetItem)}
                if sorted(gets) != [0, 1] or users.get(b.var) != 2:
                    continue
                s_at, y_at = gets[0], gets[1]
                idx = gemvs_of(bindings[y_at].var)
                residual = None
                for a, r in ((args[0], args[1]), (args[1], args[0])):
                    found = _gemv_of(_kernel(value.get(a)))
                    if found and found[5] is None and not isinstance(found[1], tuple) and users.get(a) == 1:
                        residual = (a, r, found)
                        break
                if idx is None or residual is None:
                    continue
                a, r, (m, n, k, dtype, tuning, _) = residual
                prim = make_gpu_gemv(m, n, k, dtype, tuning, "residual")
                gvar = bb.add_func(prim, str(prim.attrs["global_symbol"]))
                x_o, w_o = value[a].args[1].fields
                s = bindings[s_at].var
                new[i] = relax.VarBinding(s, relax.call_tir(gvar, [x_o, w_o, r], bindings[s_at].value.ty))
                new[s_at] = new[y_at] = None
                for j in idx:
                    new[j] = with_prologue(j, s, args[2], eps)
                changed = True
        if not changed:
            return block
        return with_bindings(block, [b for _, b in sorted(new.items()) if b is not None])

    return rewrite_decode_blocks(mod, rewrite_block)
