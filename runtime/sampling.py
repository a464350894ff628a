"""Next-token choice from one row of logits, and when a request stops.

SamplingParams are per request (the server takes them from an OpenAI request body): greedy or temperature
sampling with top-k / top-p / min-p, penalties on tokens already seen, a seed, max_tokens and stop strings.
A Sampler keeps the request's own random generator and token counts, so a request samples the same
tokens whether it runs alone or beside others in a batch. StopText turns the token stream into text deltas
(runtime/detokenize.py's), holding back what could still become a stop string.
"""
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
    min_p: float = 0.0         # drop tokens below min_p * the top token's probability
    presence_penalty: float = 0.0     # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0    # OpenAI's: minus this times how often it was generated
    repetition_penalty: float = 1.0   # transformers': logits of prompt and generated tokens divided (or times) by it
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False   # run to max_tokens whatever the model says (benchmarks; vLLM's option)

    def __post_init__(self):
        checks = (("temperature", self.temperature >= 0, ">= 0"), ("top_k", self.top_k >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
                  ("max_tokens", self.max_tokens >= 1, ">= 1"))
        for name, ok, want in checks:
            if not ok:
                raise HelmcError(f"{name} expected {want}, found {getattr(self, name)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise HelmcError(f"seed expected a non-negative integer, found {self.seed!r}")   # NumPy's generator's rule
        if not all(isinstance(s, str) and s for s in self.stop):
            raise HelmcError(f"stop expected non-empty strings, found {self.stop!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class Sampler:
    """One request's sampler: call it with each step's logits row; it remembers what it chose."""

    def __init__(self, params: SamplingParams, prompt_ids=()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}
        self.prompt = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 else set()

    def __call__(self, logits: np.ndarray) -> int:
        return self.take(self._choose(logits))

    @property
    def plain_greedy(self) -> bool:
        """The choice is the logits' argmax alone: the caller may find it where the logits are and take() it."""
        return self.params.temperature == 0 and not self.params.penalized

    def take(self, tok: int) -> int:
        """Record a token chosen for this request (what penalties count)."""
        tok = int(tok)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        return tok

    def _choose(self, logits: np.ndarray) -> int:
        p = self.params
        if p.penalized:
            logits = self._penalize(np.array(logits, dtype=np.float64))
        if p.temperature == 0:
            return int(np.argmax(logits))
        z = np.asarray(logits, dtype=np.float64)
        top = z.max()
        if not np.isfinite(top):
            raise HelmcError(f"sampling: expected finite logits, found a maximum of {top}")
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            # the max subtracted before dividing: a tiny temperature sends the others to -inf, never inf - inf
            z = (z - top) / p.temperature
        z = np.where(np.isnan(z), -np.inf, z)          # a NaN logit is never chosen
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        if p.min_p > 0:
            probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))

    def _penalize(self, z: np.ndarray) -> np.ndarray:
        p = self.params
        if p.repetition_penalty != 1.0:
            seen = np.fromiter(self.prompt | set(self.counts), dtype=np.int64)
            if seen.size:
                z[seen] = np.where(z[seen] > 0, z[seen] / p.repetition_penalty, z[seen] * p.repetition_penalty)
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self.counts, dtype=np.int64)
            n = np.fromiter(self.counts.values(), dtype=np.float64)
            z[ids] -= p.frequency_penalty * n + p.presence_penalty
        return z


class StopText:
    """Text of a growing token list, released in deltas: the detokenizer's (runtime/detokenize.py: never half a
    character), less what could still be the start of a stop string; `stopped` once a stop string appears, the text
    cut before it (of the stop strings found in one delta, the one that starts first).

    Each stop string is matched by its Knuth-Morris-Pratt automaton over the released characters, so a step costs
    its new characters plus at most the held text's length, whatever the stop strings' lengths."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        from helmc.runtime.detokenize import Detokenizer
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""          # released so far
        self.stopped = False
        self._detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self._matchers = [_StopMatcher(s) for s in stop]
        self._held = ""         # decoded, not released: a suffix that is the start of a stop string

    def add(self, token: int) -> str:
        """The delta released by one more token ("" if nothing can be released yet)."""
        self.ids.append(int(token))
        if self._detok is None or self.stopped:
            return ""
        return self._take(self._detok.add(token), final=False)

    def flush(self) -> str:
        """At the end of a request: whatever was held back (a partial stop string is text after all)."""
        if self._detok is None or self.stopped:
            return ""
        return self._take(self._detok.flush(), final=True)

    def _take(self, new: str, final: bool) -> str:
        pending = self._held + new
        cut = None
        for m in self._matchers:
            start = m.feed(new, len(self._held))
            if start is not None and (cut is None or start < cut):
                cut = start
        if cut is not None:
            self.stopped = True
            keep = pending[:cut]
        else:
            hold = 0 if final else max((m.state for m in self._matchers), default=0)
            keep = pending[:len(pending) - hold]
        self._held = pending[len(keep):]
        self.text += keep
        return keep


class _StopMatcher:
    """One stop string's KMP automaton: `state` is the length of the longest prefix of the string that the text fed
    so far ends with."""

    def __init__(self, s: str):
        self.s = s
        self.state = 0
        fail = [0] * len(s)              # fail[i]: longest proper border of s[:i + 1]
        k = 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = fail[k - 1]
            if s[i] == s[k]:
                k += 1
            fail[i] = k
        self.fail = fail

    def feed(self, text: str, offset: int) -> int | None:
        """Advance over `text`, whose first character is at `offset` of the pending text; returns the pending text's
        index where the first occurrence ending in `text` starts, or None."""
        s, fail, k = self.s, self.fail, self.state
        for j, c in enumerate(text):
            while k and c != s[k]:
                k = fail[k - 1]
            if c == s[k]:
                k += 1
            if k == len(s):
                self.state = 0
                return offset + j + 1 - len(s)
        self.state = k
        return None
