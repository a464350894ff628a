"""Relax pass for quantized weights: one copy of the block functions per type signature, and which of each
function's weight parameters are quantized (to what), for lower_linear.

A GGUF file may mix types per block (Q4_K_M keeps attn_v and ffn_down of some blocks in Q6_K); a compiled
function's weight parameters have one type each, so each distinct signature (ModelSpec.block_signatures(),
two for Q4_K_M, one otherwise) gets its own pre_attn/post_attn pair, named by
runtime.stage.block_function_name. Build cost grows with the number of signatures, not with depth.
"""
from __future__ import annotations

import tvm
from tvm import relax

from helmc.model.spec import ModelSpec, check_quant_shape
from helmc.runtime.stage import block_function_name



def weight_param_name(i: int) -> str:
    """The Relax parameter of a function's i-th weight (export_block names the ONNX inputs w0, w1, ...)."""
    return f"w{i}"


def quantize_functions(mod: tvm.IRModule, spec: ModelSpec) -> tuple[tvm.IRModule, dict]:
    """(module with a pre_attn/post_attn pair per signature, {function: {weight param: quantized type}})."""
    if not spec.quantized:
        return mod, {}
    funcs = {g.name_hint: f for g, f in mod.functions_items()}
    # prefill, decode and the batched decode variants (import_relax), as signature 0's functions name them
    phases = [name[len("pre_attn_"):] for name in funcs if name.startswith("pre_attn_")]
    weight_types: dict = {}
    moe_layer = next((i for i in range(spec.num_layers) if spec.is_moe_layer(i)), None)
    parts = [("pre_attn", lambda layer: spec.pre_attn_weight_names()),
             ("post_attn", lambda layer: spec.post_attn_weight_names())]
    if moe_layer is not None:       # a routed block's post_moe: its o_proj's type follows the block's signature
        parts.append(("post_moe", lambda layer: spec.post_attn_weight_names(moe_layer)))
    for j, signature in enumerate(spec.block_signatures()):
        layer = spec.layer_types.index(signature) if spec.layer_types else 0
        for part, names in parts:
            types = {weight_param_name(i): spec.weight_type(layer, n) for i, n in enumerate(names(layer))}
            _add_signature(funcs, weight_types, part, phases, j, types)
    if moe_layer is not None:       # the expert function, one per (gate, up, down) type signature
        for j, signature in enumerate(spec.expert_signatures()):
            _add_signature(funcs, weight_types, "expert", phases, j,
                           {weight_param_name(i): t for i, t in enumerate(signature)})
    head_type = spec.head_type
    if head_type:
        for phase in phases:
            weight_types[f"head_{phase}"] = {weight_param_name(1): head_type}   # (norm, lm_head)
    return tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), weight_types


def _add_signature(funcs: dict, weight_types: dict, part: str, phases: list, j: int, types: dict) -> None:
    """Signature j's copy of `part` in every phase (signature 0 is the exported function itself), and its
    quantized weight parameters in weight_types."""
    types = {p: t for p, t in types.items() if t}
    for phase in phases:
        name = block_function_name(part, phase, j)
        if name not in funcs:
            base = funcs[block_function_name(part, phase)]
            funcs[name] = relax.utils.copy_with_new_vars(base).with_attr("global_symbol", name)
        if types:
            weight_types[name] = types


def raw_weight_params(func: relax.Function, types: dict) -> dict:
    """{float weight param of `func`: (quantized type, the uint8 [N, row bytes] param that replaces it)} for
    `types` ({param name: type}, from quantize_functions): the raw GGUF blocks the lowering passes take."""
    out = {}
    for p in func.params:
        qtype = types.get(str(p.name))
        if qtype:
            n, k = (int(d) for d in p.ty.shape.values)
            weights, nbytes = check_quant_shape(qtype, n, k, f"weight {p.name}")
            out[p] = (qtype, relax.Var(str(p.name), relax.TensorType([n, k // weights * nbytes], "uint8")))
    unknown = set(types) - {str(p.name) for p in func.params}
    assert not unknown, f"weight types name parameters {sorted(unknown)} the function does not have"
    return out
