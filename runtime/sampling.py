"""Next-token choice from one row of logits: greedy, or temperature with top-k / top-p."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: no cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise HelmcError(f"--temperature expected >= 0, found {self.temperature}")
        if self.top_k < 0:
            raise HelmcError(f"--top-k expected >= 0, found {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise HelmcError(f"--top-p expected in (0, 1], found {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.size, p=probs))
