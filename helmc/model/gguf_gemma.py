"""Gemma 3's and gpt-oss's ModelSpec fields from a `gemma3` / `gpt-oss` GGUF file's metadata, as llama.cpp reads them
(gguf_spec's part for these architectures: the block's features have no keys of their own, llama.cpp fixes them by
architecture)."""
from __future__ import annotations

import dataclasses

import numpy as np

from helmc.errors import HelmcError
from helmc.model.spec import RopeSpec


def gemma_gguf_fields(path: str, arch: str, metadata: dict, key, fields: dict) -> dict:
    """Gemma 3's block as llama.cpp reads a gemma3 file: the norms already hold 1 + w (its converter adds the
    offset: norm_offset 0 here), the sliding blocks by {arch}.attention.sliding_window_pattern (a period, or a
    per-block list, true where sliding; absent: every sixth block global), their RoPE base rope.freq_base_swa
    (absent: 10000), the attention scaled by (hidden / heads) ** -0.5 for the 62-block 27B, head_dim ** -0.5 else."""
    n, H, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    scalar = H // heads if n == 62 else fields["head_dim"]
    return dict(norm_offset=0.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=float(H) ** 0.5,
                attn_scale=float(scalar) ** -0.5, global_layers=global_blocks(path, arch, metadata, fields, 6),
                local_rope=RopeSpec(theta=float(str(np.float32(key("rope.freq_base_swa", 10000.0, float))))))


def global_blocks(path: str, arch: str, metadata: dict, fields: dict, default: int) -> tuple[int, ...]:
    """The blocks that attend to the whole context, by {arch}.attention.sliding_window_pattern (a period, or a
    per-block list, true where sliding; absent: every `default`-th block global), as llama.cpp's load_swa_pattern."""
    n = fields["num_layers"]
    full = f"{arch}.attention.sliding_window_pattern"
    pattern = metadata.get(full, default)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    elif isinstance(pattern, list) and len(pattern) == n and all(isinstance(p, bool) for p in pattern):
        sliding = pattern
    else:
        raise HelmcError(f"{path}: {full} expected a positive integer or {n} booleans, found {pattern!r:.80}")
    if not fields["sliding_window"] and any(sliding):
        raise HelmcError(f"{path}: {arch}.attention.sliding_window expected a positive integer for "
                         f"its sliding-window blocks, found {fields['sliding_window']}")
    return tuple(i for i in range(n) if not sliding[i])


def gpt_oss_gguf_fields(path: str, arch: str, metadata: dict, tensors: dict, key, fields: dict) -> dict:
    """gpt-oss as llama.cpp reads a gpt-oss file: o_proj's bias where the file has attn_output.bias, the attention
    sinks, every other block global unless the pattern says otherwise, and its experts' routing (top-k logits then a
    softmax over those k), biases and clamped SwiGLU (llama.cpp's fixed alpha 1.702 and limit 7)."""
    return dict(o_bias="blk.0.attn_output.bias" in tensors, attn_sinks=True,
                global_layers=global_blocks(path, arch, metadata, fields, 2),
                moe=dataclasses.replace(fields["moe"], routing="topk_softmax", router_bias=True, expert_bias=True,
                                        expert_act="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0))
