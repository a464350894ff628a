"""Import phase: ONNX functions into one TVM Relax IRModule per device.

Each exported function becomes two Relax functions: `<name>_prefill` with the symbolic sequence
length, and `<name>_decode` with seq bound to 1 so decode gets static shapes (GEMV kernels, no
shape arithmetic per step).
"""
from __future__ import annotations

from helmc.compiler.passes.export_block import ExportedFunction

FUNCTION_NAMES = ("pre_attn", "post_attn", "head")


def import_functions(exported: tuple[ExportedFunction, ...]):
    import onnx
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx
    import logging
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)

    funcs = {}
    for fn in exported:
        model = onnx.load_model_from_string(fn.onnx_bytes)
        # Small constants of the graph (eps, shape vectors) become Relax constants; the weights are
        # graph inputs, so nothing large is embedded.
        mod = from_onnx(model, keep_params_in_input=False)
        main = mod["main"]
        prefill = main.with_attr("global_symbol", f"{fn.name}_prefill")
        # The decode variant gets its own parameter variables: two functions sharing Var objects make
        # an ill-formed module that Relax's fusion passes reject.
        fresh = relax.utils.copy_with_new_vars(main)
        decode_mod = relax.transform.BindSymbolicVars({"seq": 1})(tvm.IRModule({"main": fresh}))
        decode = decode_mod["main"].with_attr("global_symbol", f"{fn.name}_decode")
        funcs[f"{fn.name}_prefill"] = prefill
        funcs[f"{fn.name}_decode"] = decode
    return tvm.IRModule({tvm.ir.GlobalVar(name): f for name, f in funcs.items()})


def relax_param_shapes(mod, func_name: str) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of a Relax function's parameters; used by tests cross-checking the
    cost model's byte counts against the exported IR."""
    out = []
    for p in mod[func_name].params:
        sinfo = p.ty  # TVM 0.27 renamed struct_info to ty
        dims = tuple(int(d) if isinstance(d, int) or hasattr(d, "value") else str(d) for d in sinfo.shape.values)
        out.append((str(p.name), dims, str(sinfo.dtype)))
    return out
