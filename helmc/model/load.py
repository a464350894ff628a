"""One entry for every model input: a Hugging Face directory (or its config.json) or a GGUF file -> ModelSpec."""
from __future__ import annotations

import os

from helmc.model.spec import ModelSpec, with_weight_types


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and not path.endswith(".json")


def load_spec(path: str) -> ModelSpec:
    """The model's spec; for a GGUF file with its tensors' quantized types (ModelSpec.layer_types ...)."""
    if is_gguf(path):
        from helmc.model.gguf_spec import gguf_tensor_types, read_gguf_spec
        return with_weight_types(read_gguf_spec(path), gguf_tensor_types(path))
    return ModelSpec.from_model_dir(path)
