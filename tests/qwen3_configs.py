"""Hugging Face config.json contents of the thesis's models (Qwen3-4B/8B/14B/32B, as published on
the Hub), so the plan tests run without downloading anything. Only the keys ModelSpec reads."""
from __future__ import annotations

import json
import os

_COMMON = {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "num_key_value_heads": 8, "vocab_size": 151936,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "hidden_act": "silu",
           "torch_dtype": "bfloat16", "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645}

QWEN3 = {
    "Qwen3-4B": {**_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": True},
    "Qwen3-8B": {**_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    "Qwen3-14B": {**_COMMON, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "tie_word_embeddings": False},
    "Qwen3-32B": {**_COMMON, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "tie_word_embeddings": False},
}


def qwen3_spec(name: str, **overrides):
    from helmc.model.spec import ModelSpec
    return ModelSpec.from_hf_config({**QWEN3[name], **overrides}, name)


def write_config(directory: str, name: str, **overrides) -> str:
    """Write `name`'s config.json into `directory`; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**QWEN3[name], **overrides}, f)
    return directory
