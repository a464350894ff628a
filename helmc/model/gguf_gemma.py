"""Gemma 3's ModelSpec fields from a `gemma3` GGUF file's metadata, as llama.cpp reads them (gguf_spec's part for
this architecture: the block's features have no keys of their own, llama.cpp fixes them by architecture)."""
from __future__ import annotations

import numpy as np

from helmc.errors import HelmcError
from helmc.model.spec import RopeSpec


def gemma_gguf_fields(path: str, arch: str, metadata: dict, key, fields: dict) -> dict:
    """Gemma 3's block as llama.cpp reads a gemma3 file: the norms already hold 1 + w (its converter adds the
    offset: norm_offset 0 here), the sliding blocks by {arch}.attention.sliding_window_pattern (a period, or a
    per-block list, true where sliding; absent: every sixth block global), their RoPE base rope.freq_base_swa
    (absent: 10000), the attention scaled by (hidden / heads) ** -0.5 for the 62-block 27B, head_dim ** -0.5 else."""
    n, H, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    full = f"{arch}.attention.sliding_window_pattern"
    pattern = metadata.get(full, 6)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    elif isinstance(pattern, list) and len(pattern) == n and all(isinstance(p, bool) for p in pattern):
        sliding = pattern
    else:
        raise HelmcError(f"{path}: {full} expected a positive integer or {n} booleans, found {pattern!r:.80}")
    if not fields["sliding_window"] and any(sliding):
        raise HelmcError(f"{path}: {arch}.attention.sliding_window expected a positive integer for "
                         f"its sliding-window blocks, found {fields['sliding_window']}")
    scalar = H // heads if n == 62 else fields["head_dim"]
    return dict(norm_offset=0.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=float(H) ** 0.5,
                attn_scale=float(scalar) ** -0.5, global_layers=tuple(i for i in range(n) if not sliding[i]),
                local_rope=RopeSpec(theta=float(str(np.float32(key("rope.freq_base_swa", 10000.0, float))))))
