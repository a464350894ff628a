"""The tiny Qwen3 GPU stages the compiler tests share: exported and imported once per process (the ONNX export and
import are the slow part; the passes after them return new modules, never edit these)."""
from __future__ import annotations

import functools

BATCHES = (2, 4)


def tiny_gpu_spec(dtype: str, quantized: bool):
    """3 blocks, hidden 256, ffn 512, head_dim 64; quantized: Q4_K_M-like (q4_k linears, block 1's down_proj and the
    lm_head in q6_k: a second block signature)."""
    from helmc.model.spec import LINEAR_NAMES, ModelSpec, with_weight_types
    from helmc.testing import tiny_config
    cfg = tiny_config("qwen3", num_layers=3, head_dim=64, dtype=dtype, tie=False, hidden_size=256,
                      intermediate_size=512).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    if not quantized:
        return spec
    types = {f"model.layers.{i}.{n}": "q4_k" for i in range(3) for n in LINEAR_NAMES}
    types["model.layers.1.mlp.down_proj.weight"] = types["lm_head.weight"] = "q6_k"     # a second signature
    return with_weight_types(spec, types)


@functools.lru_cache(maxsize=None)
def imported_gpu_stage(dtype: str, quantized: bool):
    """(module, weight types) of tiny_gpu_spec's GPU stage with decode variants for BATCHES, as imported."""
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.passes.quantize_functions import quantize_functions
    spec = tiny_gpu_spec(dtype, quantized)
    return quantize_functions(import_functions(export_functions(spec, act_dtype="float16"), BATCHES), spec)


@functools.lru_cache(maxsize=None)
def quantized_lowered(dtype: str):
    """imported_gpu_stage(dtype, True) through lower_quantized_gpu, with its weight types."""
    from helmc.compiler.passes.lower_quantized_gpu import lower_quantized_gpu
    mod, weight_types = imported_gpu_stage(dtype, True)
    return lower_quantized_gpu(mod, weight_types), weight_types
