"""OpenAI's response objects for one request: whole (a completion, a chat completion) or streamed chunks, with
one choice per sample (n) and, when asked, the log-probabilities in the shape each API documents:

    chat:        choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                 "logprob", "bytes"}, ...]}, ...], "refusal": None}
    completions: choices[i].logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token:
                 logprob}, ...], "text_offset": [...]}

A completion's top_logprobs hold the asked count of best tokens and, when it is not among them, the chosen one
(OpenAI: "up to logprobs+1 elements"), keyed by text: of two tokens with one text, the likelier one's; text_offset counts characters of the choice's text, as the token texts
add up (vLLM's rule). Every generated token has its entry, the one that ended the choice (EOS) too, so a
choice's entries are as many as its completion tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from helmc.runtime.logprobs import NamedLogprob, StepLogprobs
from helmc.runtime.serve.protocol import CompletionChunk


@dataclass
class Choice:
    """One choice's output as it comes in (its text parts, log-probabilities and last chunk)."""
    text: list[str] = field(default_factory=list)
    logprobs: list[StepLogprobs] = field(default_factory=list)
    last: CompletionChunk | None = None
    offset: int = 0                       # characters of its token texts sent so far (a stream's text_offset)

    def add(self, c: CompletionChunk) -> None:
        self.text.append(c.text)
        self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.last = c


def usage(choices: list[Choice]) -> dict:
    """The prompt counted once, the choices' tokens summed."""
    prompt = next((c.last.prompt_tokens for c in choices if c.last is not None), 0)
    done = sum(c.last.completion_tokens for c in choices if c.last is not None)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _named(t: NamedLogprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": None if t.bytes is None else list(t.bytes)}


class ResponseFormat:
    def __init__(self, kind: str, rid: str, model: str, logprobs: bool):
        self.kind, self.rid, self.model, self.created = kind, rid, model, int(time.time())
        self.with_logprobs = logprobs

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, steps, offset: int = 0) -> dict | None:
        """The logprobs object of `steps` (a choice's, or a streamed chunk's, whose text starts at `offset`)."""
        if not self.with_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [{**_named(s.chosen), "top_logprobs": [_named(t) for t in s.top]} for s in steps],
                    "refusal": None}
        offsets, at = [], offset
        for s in steps:
            offsets.append(at)
            at += len(s.chosen.token)
        tops = []
        for s in steps:
            top = {}
            for t in (*s.top, s.chosen):         # two tokens of one text (U+FFFD): the likelier one names it
                top.setdefault(t.token, t.logprob)
            tops.append(top)
        return {"tokens": [s.chosen.token for s in steps], "token_logprobs": [s.chosen.logprob for s in steps],
                "top_logprobs": tops, "text_offset": offsets}

    def chunk(self, index: int, delta, finish_reason, logprobs=None) -> dict:
        """A streamed chunk of choice `index`: delta is text (or, for chat, a delta object)."""
        if self.kind == "completion":
            return {**self._head("text_completion"), "choices": [
                {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        d = delta if isinstance(delta, dict) else {"content": delta}
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def streamed(self, index: int, choice: Choice, c: CompletionChunk) -> list[dict]:
        """What one engine chunk of choice `index` sends: its text (with its tokens' logprobs: a token that
        released no text yet still has its entry) and, at its end, the finish."""
        out = []
        if c.text or (self.with_logprobs and c.logprobs):
            out.append(self.chunk(index, c.text, None, self.logprobs(c.logprobs, choice.offset)))
            choice.offset += sum(len(s.chosen.token) for s in c.logprobs)
        if c.finish_reason is not None:
            out.append(self.chunk(index, "" if self.kind == "completion" else {}, c.finish_reason))
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": usage(choices)}

    def whole(self, choices: list[Choice]) -> dict:
        out = []
        for i, ch in enumerate(choices):
            text, lp = "".join(ch.text), self.logprobs(ch.logprobs)
            if self.kind == "completion":
                out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": ch.last.finish_reason})
            else:
                out.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": ch.last.finish_reason})
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {**self._head(obj), "choices": out, "usage": usage(choices)}
