"""Greedy traces of a helmc session (every step's top logit and its lead over the runner-up), to compare two
placements of one model.

A hybrid's streamed blocks run on the GPU what the plain split runs on the CPU, so a logit's last bit can differ, and
random weights put the top two logits within an fp16 ulp often: two runs may part at a step where the top two logits
tie exactly. A wrong block moves logits by far more, so a parting away from a tie is a real difference.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Two fp16 ulps at the top logit: the GPU head's logits carry fp16 rounding (leads come in multiples
# of 2^-8 at logits in [4, 8)), so a lead this small can flip with the last bit of one block's output.
TIE_ULPS = 2


@dataclass(frozen=True)
class GreedyTrace:
    """n greedy steps after a prompt: each step's token (the first of equal maxima, as the runtime's argmax on either
    device), its logit, and its lead over the runner-up."""
    tokens: tuple[int, ...]
    top: tuple[float, ...]
    lead: tuple[float, ...]

    def __post_init__(self):
        assert len(self.tokens) == len(self.top) == len(self.lead), "one top logit and one lead per token"
        assert all(x >= 0 for x in self.lead), "a lead is top-1 minus top-2, never negative"

    def is_tie(self, step: int) -> bool:
        """The lead at `step` within TIE_ULPS fp16 ulps of its top logit."""
        return self.lead[step] <= TIE_ULPS * float(np.spacing(np.float16(abs(self.top[step]))))

    def to_json(self) -> dict:
        return {"tokens": list(self.tokens), "top": list(self.top), "lead": list(self.lead)}


def greedy_trace(session, prompt: list[int], n: int) -> GreedyTrace:
    """`n` greedy tokens after `prompt` through `session`'s decode path, every step's logits brought to the host (an
    untimed pass: V floats per step where generate brings 8 bytes)."""
    session.reset()
    logits = session.forward(prompt)[-1]                         # [S, V] -> [V], the prompt's last row
    tokens, top, lead = [], [], []
    for _ in range(n):
        t = int(np.argmax(logits))                               # the first of equal maxima
        second = float(np.max(np.delete(logits, t)))
        tokens.append(t)
        top.append(float(logits[t]))
        lead.append(float(logits[t]) - second)
        logits = session.forward([t])[-1]                        # [1, V] -> [V]
    session.reset()
    return GreedyTrace(tuple(tokens), tuple(top), tuple(lead))


def compare_greedy(a: GreedyTrace, b: GreedyTrace) -> dict:
    """bench_decode's fields for run a against run b: equal, the first step they part (len where none), and whether
    either run's logits tie there (a rounding difference, not a wrong block)."""
    n = min(len(a.tokens), len(b.tokens))
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), n)
    out = {"tokens_equal_split": a.tokens == b.tokens, "tokens_first_divergence_vs_split": first}
    if first < n:
        out["tokens_divergence_at_tie"] = a.is_tie(first) or b.is_tie(first)
        out["tokens_divergence_leads"] = [a.lead[first], b.lead[first]]
    return out
