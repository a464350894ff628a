"""The cost model's byte counts against the parameters of the exported Relax IR.

analyze_program derives W_param from config.json alone (eqs. 4.1-4.3); the compiled functions'
weight parameters are what the runtime actually streams. They must agree, per block and for the head.
"""
from __future__ import annotations

import numpy as np
import pytest

from helmc.planner.analyze_program import analyze_program
from helmc.model.spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_block_and_head_bytes_match_relax_params(tmp_path, arch):
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions, relax_param_shapes
    from helmc.testing import tiny_config
    cfg = tiny_config(arch, dtype="float16").to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM" if arch == "qwen3" else "Qwen2ForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    mod = import_functions(export_functions(spec))
    activations = {"x", "cos", "sin", "attn"}

    def weight_bytes(fn):
        return sum(int(np.prod(shape)) * DTYPE_BYTES[dt] for name, shape, dt in relax_param_shapes(mod, fn)
                   if name not in activations)
    block_ir = weight_bytes("pre_attn_decode") + weight_bytes("post_attn_decode")
    head_ir = weight_bytes("head_decode")
    a = analyze_program(spec)
    block_units = [u for u in a.units if u.kind == "block"]
    head_unit = [u for u in a.units if u.kind == "head"][0]
    print(f"{arch}: block W_param analytic {block_units[0].param_bytes} B, Relax IR {block_ir} B; "
          f"head analytic {head_unit.param_bytes} B, Relax IR {head_ir} B")
    assert all(u.param_bytes == block_ir for u in block_units)
    assert head_unit.param_bytes == head_ir
