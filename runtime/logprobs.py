"""Log-probabilities of a step's tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

They are the log-softmax of the model's raw logits for the step: OpenAI reports the model's distribution
before any sampling adjustment (temperature, top-k / top-p, penalties), so none is applied here. Computed
in float64 on the host, where the serve engine's logits already are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError

MAX_TOP_LOGPROBS = 20   # OpenAI's bound on top_logprobs
FLOOR = -9999.0         # a masked (-inf) logit's log-probability as vLLM reports it: JSON has no -Infinity


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the step's `top` most likely tokens, best first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    return x - _log_sum_exp(x)


def _log_sum_exp(x: np.ndarray) -> float:
    m = x.max()
    if not np.isfinite(m):          # NaN or +inf: no distribution (the caller refuses it)
        return float(m)
    return float(m + np.log(np.exp(x - m).sum()))


def token_logprob(logits, token_id: int, top: int = 0) -> TokenLogprob:
    """token_id's log-probability under the raw logits, and the `top` best tokens (ties by lower id). Only the
    log-sum-exp goes over the whole vocabulary; the top tokens are found on the logits (same order)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if not 0 <= token_id < x.size:
        raise ValueError(f"token id in [0, {x.size}) expected, found {token_id}")
    lse = _log_sum_exp(x)
    if not np.isfinite(lse):
        raise HelmcError(f"log-probabilities: expected finite logits, found a log-sum-exp of {lse}")
    top = min(max(int(top), 0), MAX_TOP_LOGPROBS, x.size)
    best = ()
    if top:
        idx = np.argpartition(x, x.size - top)[x.size - top:]
        idx = sorted(idx.tolist(), key=lambda i: (-x[i], i))
        best = tuple((i, max(float(x[i] - lse), FLOOR)) for i in idx)
    return TokenLogprob(int(token_id), max(float(x[token_id] - lse), FLOOR), best)


# ------------------------------------------------------------------ tokens as the API names them
@dataclass(frozen=True)
class NamedLogprob:
    """A token as OpenAI's logprobs name it: its text, its UTF-8 bytes (None when no tokenizer can tell) and
    its log-probability."""
    token: str
    bytes: tuple[int, ...] | None
    logprob: float


@dataclass(frozen=True)
class StepLogprobs:
    """One generated token's NamedLogprob and the step's top tokens, best first."""
    chosen: NamedLogprob
    top: tuple[NamedLogprob, ...] = ()


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the character a byte-level BPE vocabulary writes for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenPieces:
    """Each token id's text and bytes, computed once per id. A token that holds part of a character (byte-level
    BPE, or a SentencePiece byte-fallback token <0xE3>) decodes to U+FFFD alone; its bytes are then read from
    its vocabulary entry, so a client can join the bytes of consecutive tokens into the character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, tuple[int, ...] | None]] = {}
        self._bytes_of = _byte_level_decoder()

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...] | None]:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> tuple[str, tuple[int, ...] | None]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", None          # vLLM's name for a token it cannot detokenize
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, tuple(text.encode("utf-8"))
        entry = self.tokenizer.id_to_token(token_id) or ""
        if len(entry) == 6 and entry.startswith("<0x") and entry.endswith(">"):
            try:
                return text, (int(entry[3:5], 16),)
            except ValueError:
                pass
        if entry and all(c in self._bytes_of for c in entry):
            return text, tuple(self._bytes_of[c] for c in entry)
        return text, tuple(text.encode("utf-8"))

    def name(self, lp: TokenLogprob) -> StepLogprobs:
        def named(tid, value):
            text, raw = self(tid)
            return NamedLogprob(text, raw, value)
        return StepLogprobs(named(lp.token_id, lp.logprob), tuple(named(t, v) for t, v in lp.top))
