"""Import phase: ONNX functions into one TVM Relax IRModule per device.

Each exported function becomes two Relax functions: `<name>_prefill` with the symbolic sequence
length, and `<name>_decode` with seq bound to 1 so decode gets static shapes (GEMV kernels, no
shape arithmetic per step); and, per batch size B of `batch_sizes` (stage.decode_batch_sizes of the
plan's batch), `<name>_decode_b{B}` with seq bound to B: a batched decode step of B sequences, one
row each, on the same static-count GEMVs, whose rows are bit-identical to the one-row decode's.
"""
from __future__ import annotations

from helmc.compiler.passes.export_block import ExportedFunction
from helmc.runtime.stage import batch_phase

FUNCTION_NAMES = ("pre_attn", "post_attn", "head")


def import_functions(exported: tuple[ExportedFunction, ...], batch_sizes: tuple[int, ...] = ()):
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
        funcs[f"{fn.name}_prefill"] = main.with_attr("global_symbol", f"{fn.name}_prefill")
        for rows in (1,) + tuple(batch_sizes):
            # Each static variant gets its own parameter variables: two functions sharing Var objects make
            # an ill-formed module that Relax's fusion passes reject.
            fresh = relax.utils.copy_with_new_vars(main)
            bound = relax.transform.BindSymbolicVars({"seq": rows})(tvm.IRModule({"main": fresh}))
            name = f"{fn.name}_{batch_phase(rows)}"
            funcs[name] = bound["main"].with_attr("global_symbol", name)
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
