"""Relax pass: a decode step's RMSNorm folded into the fp16 / bf16 GEMVs that read its output (issue 16).

After fuse_gpu_norms a decode layer still launches two norm kernels ahead of its GEMVs, each one thread block
over one row of 4096 values (~4 us of latency in a 4.5 ms Qwen3-8B step, 72 of them), while the GEMV's blocks
read all of that row anyway. schedules/gpu/gemv.py's norm prologue takes the norm's input and weight instead
and scales its sums by 1 / sqrt(mean(x^2) + eps). In every decode function:

  y = rms_norm(x, g); GEMVs of y          -> GEMVs of (x, g) with the prologue
  (s, y) = add_rms_norm(a, b, g), a = one-weight GEMV(x_o, w_o) read only here; GEMVs of y
                                          -> s = the residual-epilogue GEMV(x_o, w_o, b) (bit-identical s: the
                                             same rounded product and fp16 add), GEMVs of (s, g) with the prologue

where "GEMVs of y" is every use of y, each a gemv.py kernel with y as its x (one weight, q/k/v's shared-x launch,
or the SwiGLU pair) and no residual epilogue. Anything else is left as it was (the int8 GEMVs of quantized
weights, prefill). The normed row is no longer rounded to fp16 before the products: outputs move within fp16
rounding, not bit for bit; a batched step's rows are still each sequence's one-row bits (the prologue is per row).
Runs after fuse_gpu_norms (whose kernels carry their eps as the attribute helmc_eps).
"""
from __future__ import annotations

import re

import tvm
from tvm import relax

from helmc.compiler.passes.lower_decode_gemv import _users, rewrite_decode_blocks, with_bindings
from helmc.schedules.gpu.gemv import make_gpu_gemv

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_GEMV = re.compile(r"^helmc_gpu_gemv_(swiglu_)?(f16|bf16)_m(\d+)_n([\d_]+)_k(\d+)(?:_r(\d+)w(\d+)u(\d+))?$")
_DTYPE = {"f16": "float16", "bf16": "bfloat16"}


def _kernel(value) -> str | None:
    if isinstance(value, relax.Call) and value.op == _CALL_TIR and isinstance(value.args[0], relax.GlobalVar):
        return value.args[0].name_hint
    return None


def _gemv_of(name: str | None):
    """(m, n or row counts, k, dtype, tuning or None, epilogue) of a gemv.py kernel name without a prologue or the
    residual epilogue, else None."""
    found = _GEMV.match(name or "")
    if not found:
        return None
    swiglu, dtype, m, n, k, *tune = found.groups()
    ns = tuple(int(v) for v in n.split("_"))
    tuning = tuple(int(v) for v in tune) if tune[0] else None
    return int(m), ns if len(ns) > 1 else ns[0], int(k), _DTYPE[dtype], tuning, "swiglu" if swiglu else None


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
