"""Relax pass: the GPU stage's quantized weights as their raw GGUF blocks (uint8 [N, row bytes]).

For each function with quantized weight parameters (quantize_functions gives which, per function):
- decode (one token, or one per sequence in the batched decode_b{B} variants): every linear over a quantized
  weight becomes a call to the fused dequantize-GEMV for that many rows (schedules/gpu/quant_gemv.
  make_gpu_gemv_quant; for the types weight_types gives a gpu_gemv_int8, quant_gemv_int8.make_gpu_gemv_int8, over
  int8 activations as llama.cpp's
  CUDA decode: the weight is read once, as stored, and each row's sums are formed as in the one-row kernel, so
  a batched step gives each sequence its own decode's bits);
- prefill: the weight is dequantized to fp16 once per call (make_gpu_dequantize) and the graph is left as it
  was, so the prompt's matmuls keep dlight's tensor-core-free SIMT schedule (compile_gpu_stage). Each dequantize
  is bound just before the weight's first use, so its [N, K] fp16 buffer lives until its matmul only and the VM's
  memory planning reuses one buffer for the block's weights (the largest is the lm_head's, when it is quantized
  and on the GPU).
Runs before compile_gpu_stage's fp32-accumulation rewrite, which then sees only unquantized matmuls.
"""
from __future__ import annotations

import functools
import re

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.utils import copy_with_new_vars

from helmc.compiler.passes.lower_decode_gemv import fuse_gemv_epilogues, one_launch_per_shared_x
from helmc.compiler.passes.quantize_functions import raw_weight_params
from helmc.model.weight_types import BLOCK_TYPES, GPU_INT8_EPILOGUES, GPU_INT8_TYPES, WEIGHT_TYPES
from helmc.schedules.gpu import quant_gemv


# (rows per warp, warps, unroll) of the decode GEMV per type, and of the int8-activation GEMV (alone and with each
# epilogue) for the types that have one: weight_types' table, which says where each tuning was measured.
GEMV_TUNING = {q: WEIGHT_TYPES[q].gpu_gemv_tuning for q in BLOCK_TYPES}
GEMV_INT8_TUNING = {q: WEIGHT_TYPES[q].gpu_int8_tuning for q in GPU_INT8_TYPES}
GEMV_INT8_EPILOGUE_TUNING = {(q, e): WEIGHT_TYPES[q].gpu_epilogue_tuning(e)
                             for q in GPU_INT8_TYPES for e in GPU_INT8_EPILOGUES}


# The kernel makers below are memoized per process: a PrimFunc is immutable and writing one through TVMScript takes
# 0.1-1 s, so a stage lowered twice (its lowered form read, then compiled) or several stages of the same shapes in one
# process (the profile kit's GEMVs beside its GPU stage) make each kernel once.
@functools.lru_cache(maxsize=None)
def make_gpu_gemv_int8(qtype: str, *args, **kw):
    """The int8-activation decode GEMV of `qtype` (weight_types' gpu_gemv_int8 maker)."""
    return WEIGHT_TYPES[qtype].maker("gpu_gemv_int8")(qtype, *args, **kw)


@functools.lru_cache(maxsize=None)
def make_gpu_gemv_quant(qtype: str, *args, **kw):
    """The decode GEMV of `qtype` (weight_types' gpu_gemv maker)."""
    return WEIGHT_TYPES[qtype].maker("gpu_gemv")(qtype, *args, **kw)


@functools.lru_cache(maxsize=None)
def make_gpu_dequantize(qtype: str, n: int, k: int):
    """The prefill's dequantize of an [n, k] `qtype` weight to fp16 (quant_gemv.make_gpu_dequantize)."""
    return quant_gemv.make_gpu_dequantize(qtype, n, k)
OP_PATTERN_OPAQUE = 8               # relax OpPatternKind kOpaque: FuseOps fuses it with nothing
_DECODE = re.compile(r"_decode(_b\d+)?(_t\d+)?$")   # runtime.stage.block_function_name's decode functions


def lower_quantized_gpu(mod: tvm.IRModule, weight_types: dict) -> tvm.IRModule:
    """`weight_types`: {function name: {weight parameter name: quantized type}} (quantize_functions)."""
    rewriter = _QuantizedLinears(mod)
    for gvar, func in list(mod.functions_items()):
        types = weight_types.get(gvar.name_hint, {})
        if not isinstance(func, relax.Function) or not types:
            continue
        fresh = copy_with_new_vars(func)
        quantized = raw_weight_params(fresh, types)
        params = [quantized[p][1] if p in quantized else p for p in fresh.params]
        if _DECODE.search(gvar.name_hint):
            rewriter.quantized = quantized
            body = rewriter.visit_expr(fresh.body)
            new = relax.analysis.remove_all_unused(relax.Function(params, body, fresh.ret_ty, fresh.is_pure, fresh.attrs))
            left = [str(p.name) for p in quantized if p in set(relax.analysis.free_vars(new))]
            assert not left, f"{gvar.name_hint}: quantized weights {left} are used other than by a linear"
        else:
            new = _dequantize_at_use(rewriter, fresh, params, quantized)
        rewriter.builder_.update_func(gvar, new)
    return _one_launch_per_shared_x(rewriter.builder_.get(), rewriter.kernels)


def _one_launch_per_shared_x(mod: tvm.IRModule, kernels: dict) -> tvm.IRModule:
    """SwiGLU over the gate and up int8 GEMVs and the block's last residual add as their GEMV's epilogue (one launch
    each, lower_decode_gemv.fuse_gemv_epilogues), then the int8 GEMVs left of one x and type (q, k, v) as one launch
    over up to 3 weights (make_gpu_gemv_int8 with a tuple of row counts): x is quantized once per CTA for all of
    them. Every output is bit-identical to the separate kernels'. kernels: the rewriter's {("gemv8", qtype, m, n,
    k): GlobalVar, ...}."""
    gemvs = {gvar.name_hint: ((key[1], key[2], key[4]), key[3]) for key, gvar in kernels.items() if key[0] == "gemv8"}
    mod = fuse_gemv_epilogues(mod, gemvs, lambda kind, n, epilogue: make_gpu_gemv_int8(
        kind[0], n, kind[2], *GEMV_INT8_EPILOGUE_TUNING[(kind[0], epilogue)], m=kind[1], epilogue=epilogue))
    return one_launch_per_shared_x(
        mod, gemvs, lambda kind, ns: make_gpu_gemv_int8(kind[0], ns, kind[2], *GEMV_INT8_TUNING[kind[0]], m=kind[1]))


def _dequantize_at_use(rewriter, func: relax.Function, params: list, quantized: dict) -> relax.Function:
    """func with each quantized weight dequantized to fp16 by a binding just before the first binding that reads it,
    in that binding's block. Each fp16 copy is then live only from its dequantize to its matmul, so the VM's static
    memory planning reuses one buffer for the block's weights in turn (the largest) instead of holding all of them
    for the call (otherwise a Qwen3-8B Q4_K block's seven fp16 copies, 0.36 GiB of VRAM no plan counted;
    cost_model.quantized_prefill_scratch_bytes counts what is left)."""
    pending, remap = dict(quantized), {}
    blocks = []
    for block in func.body.blocks:
        dataflow = isinstance(block, relax.DataflowBlock)
        out = []
        for binding in block.bindings:
            for p in [p for p in relax.analysis.free_vars(binding.value) if p in pending]:
                qtype, raw = pending.pop(p)
                n, k = (int(d) for d in p.ty.shape.values)
                gvar = rewriter.kernel(("dequantize", qtype, n, k),
                                       lambda: _in_root_block(make_gpu_dequantize(qtype, n, k)))
                ty = relax.TensorType([n, k], "float16")
                w16 = (relax.DataflowVar if dataflow else relax.Var)(f"{p.name}_fp16", ty)
                out.append(relax.VarBinding(w16, relax.call_tir(gvar, [raw], ty)))
                remap[p] = w16
            out.append(binding)
        blocks.append(relax.DataflowBlock(out) if dataflow else relax.BindingBlock(out))
    assert not [p for p in pending if p in set(relax.analysis.free_vars(func.body))], "a weight read outside bindings"
    body = _Substitute(remap).visit_expr(relax.SeqExpr(blocks, func.body.body))
    return relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)


def _in_root_block(func):
    """func's body inside a root block, fused with nothing: in a dataflow block, RewriteDataflowReshape asks whether
    each one-input call_tir is a reshape, and that analysis expects a block-structured PrimFunc (a hand-written
    kernel's body is a loop nest)."""
    from tvm import s_tir
    root = s_tir.SBlock(iter_vars=[], reads=[], writes=[], name_hint="root", body=func.body)
    body = s_tir.SBlockRealize(iter_values=[], predicate=True, block=root)
    return func.with_body(body).with_attr("op_pattern", OP_PATTERN_OPAQUE)


@mutator
class _Substitute(PyExprMutator):
    def __init__(self, mapping: dict):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var):  # noqa: N802 (TVM's visitor name)
        return self.mapping.get(var, var)


@mutator
class _QuantizedLinears(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.kernels: dict = {}
        self.quantized: dict = {}

    def kernel(self, key: tuple, make) -> relax.GlobalVar:
        if key not in self.kernels:
            prim = make()
            self.kernels[key] = self.builder_.add_func(prim, str(prim.attrs["global_symbol"]))
        return self.kernels[key]

    def _weight(self, expr):
        """The quantized parameter under permute_dims(astype?(w)), or None."""
        bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        if not (isinstance(bound, relax.Call) and bound.op == tvm.ir.Op.get("relax.permute_dims")):
            return None
        w = bound.args[0]
        inner = self.lookup_binding(w) if isinstance(w, relax.Var) else None
        if isinstance(inner, relax.Call) and inner.op == tvm.ir.Op.get("relax.astype"):
            w = inner.args[0]
        return w if w in self.quantized else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's visitor name)
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        w = self._weight(call.args[1])
        if w is None:
            return call
        qtype, blocks = self.quantized[w]
        x = call.args[0]
        n, k = (int(d) for d in w.ty.shape.values)
        m = int(x.ty.shape.values[0])
        assert [int(d) for d in x.ty.shape.values] == [m, k], f"decode linear expected x of shape [m, {k}]"
        if WEIGHT_TYPES[qtype].gpu_gemv_int8:
            gvar = self.kernel(("gemv8", qtype, m, n, k),
                               lambda: make_gpu_gemv_int8(qtype, n, k, *GEMV_INT8_TUNING[qtype], m=m))
        else:
            gvar = self.kernel(("gemv", qtype, m, n, k),
                               lambda: make_gpu_gemv_quant(qtype, n, k, *GEMV_TUNING[qtype], m=m))
        if str(x.ty.dtype) != "float16":
            x = self.builder_.emit(relax.op.astype(x, "float16"))
        y = relax.call_tir(gvar, [x, blocks], relax.TensorType([m, n], "float16"))
        out_dtype = str(call.ty.dtype)
        return y if out_dtype == "float16" else relax.op.astype(self.builder_.emit(y), out_dtype)
