"""Log-probabilities of a step's tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

They are the log-softmax of the model's raw logits for the step: OpenAI reports the model's distribution
before any sampling adjustment (temperature, top-k / top-p, penalties), so none is applied here. Computed
in float64 on the host, where the serve engine's logits already are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20   # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the step's `top` most likely tokens, best first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprob(logits, token_id: int, top: int = 0) -> TokenLogprob:
    """token_id's log-probability under the raw logits, and the `top` best tokens (ties by lower id)."""
    lp = log_softmax(logits)
    if not 0 <= token_id < lp.size:
        raise ValueError(f"token id in [0, {lp.size}) expected, found {token_id}")
    top = min(max(int(top), 0), MAX_TOP_LOGPROBS, lp.size)
    best = ()
    if top:
        idx = np.argpartition(-lp, top - 1)[:top]
        idx = sorted(idx.tolist(), key=lambda i: (-lp[i], i))
        best = tuple((i, float(lp[i])) for i in idx)
    return TokenLogprob(int(token_id), float(lp[token_id]), best)
