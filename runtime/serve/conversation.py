"""A conversation with the serving engine (`helmc chat`): the messages so far rendered with the chat template,
tokenized and submitted as one request whose reply is kept within the model's context."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from helmc.runtime.sampling import SamplingParams
from helmc.runtime.serve.protocol import Request


@dataclass(frozen=True)
class Sampling:
    """How each reply is sampled; checked (SamplingParams') when made, before any loading."""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        self.params(self.max_new_tokens)

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, max_tokens=max_tokens)


class Conversation:
    """The engine (stepped and cancelled by the caller), its chat template and how replies are sampled."""

    def __init__(self, engine, template, sampling: Sampling):
        self.engine, self.template, self.sampling = engine, template, sampling
        self._ids = itertools.count()

    def submit(self, messages: list[dict], sink) -> tuple[str, int]:
        """Submit the reply to `messages`; `sink` gets each chunk. Returns (the request's id, the prompt's tokens)."""
        engine = self.engine
        prompt = engine.tokenizer.encode(self.template.render(messages, add_generation_prompt=True),
                                         add_special_tokens=False).ids
        room = engine.model.max_context - len(prompt)
        req = Request(f"chat-{next(self._ids)}", tuple(prompt),
                      self.sampling.params(max(1, min(self.sampling.max_new_tokens, room))))
        engine.submit(req, sink)
        return req.request_id, len(prompt)
