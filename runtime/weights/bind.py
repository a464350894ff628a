"""Binding checkpoint tensors to the compiled functions' weight parameters.

Weights go from the mmapped safetensors to their device tensor one at a time: the NumPy view is a
window on the page cache and the only resident copy is the device tensor, so loading never holds a
second full copy of the model (DEVELOPERS.md).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from helmc.model.spec import ModelSpec

from helmc.runtime.weights.safetensors_mmap import Checkpoint
from helmc.runtime.stage import StageBinding

def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes = spec.block_weight_shapes()
    out = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    for i in range(spec.num_layers):
        for name, shape in shapes.items():
            out[f"model.layers.{i}.{name}"] = shape
    return out


def tensor_to_device(view: np.ndarray, dtype: str, dev):
    """One checkpoint tensor onto a TVM device; bf16 arrives as uint16 raw bits."""
    import tvm.runtime
    if dtype == "bfloat16":
        from helmc.runtime.tvm_tensors import tensor_from_numpy
        return tensor_from_numpy(view, "bfloat16", dev)
    return tvm.runtime.tensor(np.ascontiguousarray(view), dev)


def bind_layers(ck: Checkpoint, spec: ModelSpec, layers: range, dev,
                progress: Callable[[str], None] = lambda m: None,
                to_device: Callable = tensor_to_device) -> list[StageBinding]:
    shapes = spec.block_weight_shapes()
    out = []
    for n, i in enumerate(layers):
        def load(name):
            full = f"model.layers.{i}.{name}"
            return to_device(ck.view(full, shapes[name]), ck.info(full).dtype, dev)
        out.append(StageBinding(pre=[load(w) for w in spec.pre_attn_weight_names()],
                                post=[load(w) for w in spec.post_attn_weight_names()]))
        progress(f"  weights: block {i} ({n + 1}/{len(layers)}) bound")
    return out


def bind_head(ck: Checkpoint, spec: ModelSpec, dev, to_device: Callable = tensor_to_device) -> list:
    norm, lm = spec.head_weight_names()
    return [to_device(ck.view(norm, (spec.hidden_size,)), ck.info(norm).dtype, dev),
            to_device(ck.view(lm, (spec.vocab_size, spec.hidden_size)), ck.info(lm).dtype, dev)]
