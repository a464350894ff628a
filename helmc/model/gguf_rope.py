"""YaRN RoPE from a GGUF file's metadata, as llama.cpp reads and runs it (gguf_spec's part for this scaling type)."""
from __future__ import annotations

import math

import numpy as np

from helmc.errors import HelmcError
from helmc.model.spec import RopeSpec


def yarn_gguf_rope(path: str, arch: str, metadata: dict, key, theta: float, factor: float) -> RopeSpec:
    """YaRN as llama.cpp runs it: the ramp's ends rounded outwards (truncate), beta_fast 32 and beta_slow 1 unless
    given, cos and sin scaled by 0.1 ln(factor) + 1; a file scaling them otherwise is refused, not misread. `key`
    reads {arch}.NAME as gguf_spec's reader does."""
    for other in ("rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier",
                  "rope.scaling.yarn_ext_factor"):
        if f"{arch}.{other}" in metadata:
            raise HelmcError(f"{path}: YaRN RoPE expected llama.cpp's default attention scale, found "
                             f"{arch}.{other} = {metadata[f'{arch}.{other}']!r:.40}")
    if factor <= 1.0:
        raise HelmcError(f"{path}: {arch}.rope.scaling.factor expected above 1 for YaRN, found {factor}")
    factor = _f32(factor)
    return RopeSpec(theta=theta, kind="yarn", factor=factor, original_max_position=key("rope.scaling.original_context_length"),
                    beta_fast=_f32(key("rope.scaling.yarn_beta_fast", 32.0, float)),
                    beta_slow=_f32(key("rope.scaling.yarn_beta_slow", 1.0, float)), truncate=True,
                    attention_factor=0.1 * math.log(factor) + 1.0)


def _f32(v: float) -> float:
    # GGUF stores these as float32; the shortest decimal that rounds to it is what config.json said
    return float(str(np.float32(v)))
