"""KVOptions: how a session's KV caches are sized and driven, with the defaults defined once.

The planner sizes a plan's KV with the same page size and watermark (planner/cost_model imports these), so a
session loaded with the defaults holds what its plan counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from helmc.errors import HelmcError

KV_PAGE_TOKENS = 512      # thesis 4.2.2: one KV page holds 512 tokens
KV_WATERMARK = 0.8        # thesis 4.2.2: KV may fill 80% of the VRAM left after weights

# Session.load's keyword spelling of each field (the CLI's --kv-page-tokens, --kv-watermark, --no-kv-offload).
_KEYWORDS = {"kv_page_tokens": "page_tokens", "kv_watermark": "watermark", "kv_offload": "offload",
             "cuda_graph": "cuda_graph"}


@dataclass(frozen=True)
class KVOptions:
    page_tokens: int = KV_PAGE_TOKENS   # tokens per KV page, CPU and GPU caches
    watermark: float = KV_WATERMARK     # share of the GPU page pool KV may fill before pages move to pinned host RAM
    offload: bool = True                # pages beyond the GPU pool go to pinned host RAM (else: out of pages)
    cuda_graph: bool = True             # the GPU stage's decode step replayed as a CUDA graph

    def __post_init__(self):
        if isinstance(self.page_tokens, bool) or not isinstance(self.page_tokens, int) or self.page_tokens < 1:
            raise HelmcError(f"--kv-page-tokens expected a positive integer, found {self.page_tokens}")
        if not 0 < self.watermark <= 1:
            raise HelmcError(f"--kv-watermark expected in (0, 1], found {self.watermark}")

    @classmethod
    def from_keywords(cls, options: dict) -> "KVOptions":
        """From Session.load's keywords (kv_page_tokens=, kv_watermark=, kv_offload=, cuda_graph=)."""
        unknown = sorted(set(options) - set(_KEYWORDS))
        if unknown:
            raise HelmcError(f"KV options: expected keywords among {', '.join(_KEYWORDS)}, found {', '.join(unknown)}")
        return cls(**{_KEYWORDS[k]: v for k, v in options.items()})
