"""The one interface of a KV cache, as llama.cpp's llama_memory_i and vLLM's KVCacheManager declare theirs.

A stage (runtime/stage.py), a session and the streamed prefill hold "a cache" of either kind: KVCacheCPU
(kv/cache_cpu.py, host arrays) or KVCacheGPU (kv/cache_gpu.py, device arrays); both implement KVCache. A step of
S rows is: append(layer, k, v) for every layer, each followed by attend(layer, q, scale), then advance(S), which
commits the rows; reset() forgets the sequence. Arrays are the cache's own kind (NumPy or CuPy).

What only the GPU cache has (begin_step, graph_key, forget_appends, mark_replayed for CUDA graph capture,
lend_empty_pool for the streamed prefill's loan, attend's `out=`) is called only by code that holds a
KVCacheGPU by construction (gpu_session, hybrid/, serve/batch_model, decode_batch_gpu, measure_bundle);
tests/runtime/test_kv_interface.py checks that the stages call nothing else on the cache they are given.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KVCache(Protocol):
    max_tokens: int          # tokens the cache holds at most (its capacity, checked before a request runs)

    @property
    def length(self) -> int:
        """Tokens committed (advanced) so far."""

    def reset(self) -> None:
        """Forget the sequence (a new request)."""

    def append(self, layer: int, k, v) -> None:
        """Write this step's K, V rows [S, h_kv, d] of `layer`; once per layer per step."""

    def attend(self, layer: int, q, scale: float):
        """Causal attention of the step's S query rows [S, h_a, d] over every cached token of `layer` (the
        step's own rows included, appended first); returns [S, h_a, d]."""

    def advance(self, S: int) -> None:
        """Commit the step's S rows, appended by every layer."""


KV_CACHE_METHODS = ("reset", "append", "attend", "advance")
