"""Attention sinks (gpt-oss): per layer, a learned logit per query head that joins the softmax's denominator with no
value. The per-layer vectors both KV caches take (KVCacheCPU, KVCacheGPU: `sinks=`), checked here once; how each
attention path starts its state from them: runtime/kv/paged_attention.py (NumPy / CuPy) and the CUDA kernels'
modules (schedules/gpu/paged_attention.py, paged_decode_short.py, flash_prefill.py)."""
from __future__ import annotations

import numpy as np

from helmc.errors import HelmcError


def checked_sinks(sinks, num_layers: int, num_kv_heads: int, who: str) -> tuple[np.ndarray, ...] | None:
    """Per-layer sink logits as contiguous float32 vectors, checked: one per layer, a positive multiple of the KV
    heads each, finite; None stays None (a model without sinks)."""
    if sinks is None:
        return None
    try:
        out = tuple(np.ascontiguousarray(np.asarray(s, dtype=np.float32).reshape(-1)) for s in sinks)
    except (TypeError, ValueError):
        raise HelmcError(f"{who}: sinks expected {num_layers} vectors of numbers, found {sinks!r:.80}") from None
    if len(out) != num_layers or any(s.shape[0] % num_kv_heads or s.shape[0] == 0 or not np.isfinite(s).all()
                                     for s in out):
        raise HelmcError(f"{who}: sinks expected {num_layers} finite vectors of a multiple of {num_kv_heads} "
                         f"(the KV heads) logits, found {[s.shape[0] for s in out]}")
    return out


def sinks_of_layer(sinks, layer: int, num_heads: int, who: str):
    """Layer `layer`'s entry of `sinks` (checked_sinks' vectors, or any per-layer sequence alongside them, such as
    their device copies), checked against the query's num_heads; None without sinks."""
    if sinks is None:
        return None
    if sinks[layer].shape[0] != num_heads:
        raise HelmcError(f"{who}.attend: {sinks[layer].shape[0]} attention sinks for layer {layer} "
                         f"expected one per query head, found {num_heads} heads")
    return sinks[layer]
