"""What flows between the HTTP side and the engine thread, and the OpenAI request bodies they come from.

A request body (JSON, bounded by limits.py) becomes a ParsedRequest after a strict check: every known field of
the right type and within its range; an unknown field is ignored and named in ParsedRequest.ignored (the server
returns it in a Warning header, as vLLM logs it); a bad one is an OpenAIError carrying the HTTP status and
OpenAI's error body ({"error": {"message", "type", "param", "code"}}). The engine sees only a Request (token ids,
SamplingParams, and how many top tokens' log-probabilities it wants, if any) and answers with CompletionChunks, one
per step of the request. A body asking for n choices becomes n Requests (choice_params: a seed derived per choice).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from helmc.errors import HelmcError
from helmc.runtime.logprobs import StepLogprobs
from helmc.runtime.sampling import SamplingParams
from helmc.runtime.serve import limits
from helmc.runtime.serve.errors import OpenAIError

__all__ = ["OpenAIError", "Request", "CompletionChunk", "ParsedRequest", "parse_body", "choice_params"]


@dataclass(frozen=True)
class Request:
    """One generation: the prompt as token ids and how to sample; request_id is unique per server. logprobs: None
    for none (the engine then computes nothing), else each token's log-probability and this many top tokens."""
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    logprobs: int | None = None

    @property
    def tokens(self) -> int:
        """Context the request may fill: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.params.max_tokens


@dataclass(frozen=True)
class CompletionChunk:
    """What one engine step produced for a request: new token ids, the text they released and, when the request
    asked, each token's log-probabilities; the last chunk of a request has a finish_reason ("stop" | "length" |
    "error") and the usage counts."""
    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    logprobs: tuple[StepLogprobs, ...] = ()


# -------------------------------------------------------------------- request bodies
def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _response_format(v):
    return v is None or (isinstance(v, dict) and v.get("type") == "text")


_UNSUPPORTED = {   # field -> (accepted when, what the 400 says): OpenAI features this server does not implement
    "best_of": (lambda v: v is None or v == 1, "best_of: only 1 is supported (n choices are n samples), found {}"),
    "echo": (lambda v: v is None or v is False, "echo: not supported, found {}"),
    "logit_bias": (lambda v: v is None or v == {}, "logit_bias: not supported, found {}"),
    "suffix": (lambda v: v is None, "suffix: not supported, found {}"),
    "response_format": (_response_format, 'response_format: only {{"type": "text"}} is supported (no JSON mode), '
                                          'found {}'),
}
_TYPES = {  # field -> (check, what the error says it expected)
    "model": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (lambda v: v is None or _int(v), "an integer"),
    "max_completion_tokens": (lambda v: v is None or _int(v), "an integer"),
    "temperature": (lambda v: v is None or _number(v), "a number"),
    "top_p": (lambda v: v is None or _number(v), "a number"),
    "top_k": (lambda v: v is None or _int(v), "an integer"),
    "min_p": (lambda v: v is None or _number(v), "a number"),
    "presence_penalty": (lambda v: v is None or _number(v), "a number"),
    "frequency_penalty": (lambda v: v is None or _number(v), "a number"),
    "repetition_penalty": (lambda v: v is None or _number(v), "a number"),
    "seed": (lambda v: v is None or _int(v), "an integer"),
    "stream": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: v is None or (isinstance(v, dict) and set(v) <= {"include_usage", "continuous_usage_stats"}),
                       "an object with include_usage"),
    "stop": (lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or a list of strings"),
    "n": (lambda v: v is None or _int(v), "an integer"),
    "best_of": (lambda v: v is None or _int(v), "an integer"),
    "user": (lambda v: v is None or isinstance(v, str), "a string"),
    "top_logprobs": (lambda v: v is None or _int(v), "an integer"),
    "echo": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "logit_bias": (lambda v: v is None or isinstance(v, dict), "an object"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "an object"),
    "store": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "tools": (lambda v: v is None or (isinstance(v, list) and all(isinstance(t, dict) for t in v)), "a list of objects"),
    "tool_choice": (lambda v: v is None or isinstance(v, (str, dict)), "a string or an object"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "response_format": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("type"), str)),
                        'an object with a type, e.g. {"type": "text"}'),
    "chat_template_kwargs": (lambda v: v is None or isinstance(v, dict), "an object"),
    "ignore_eos": (lambda v: v is None or isinstance(v, bool), "a boolean"),
}
_COMPLETION_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "seed", "stream", "stream_options", "stop", "n",
                      "user", "logprobs", "echo", "best_of", "logit_bias", "suffix", "model", "ignore_eos"}
_CHAT_FIELDS = (_COMPLETION_FIELDS - {"prompt", "echo", "best_of", "suffix"}) | {
    "messages", "max_completion_tokens", "top_logprobs", "metadata", "store", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "chat_template_kwargs"}
# the variables the renderer passes a chat template itself: a chat_template_kwargs key may not replace them
TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


@dataclass(frozen=True)
class ParsedRequest:
    """A checked body: the prompt (text or token ids for completions; messages for chat) and its options;
    ignored: the unknown fields it carried."""
    kind: str                                  # "completion" | "chat"
    model: str
    prompt: str | tuple[int, ...] = ""
    messages: tuple = ()
    tools: tuple = ()
    template_kwargs: dict = field(default_factory=dict)
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)   # SamplingParams fields besides max_tokens
    ignored: tuple[str, ...] = ()
    n: int = 1                                     # choices: n independent samples of the prompt
    logprobs: int | None = None                    # None: none asked; else top tokens per step (0: the chosen only)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except HelmcError as e:     # the message names the field first: "temperature expected >= 0, found -1"
            raise OpenAIError(str(e), param=str(e).split(" ")[0]) from None


def parse_body(raw: bytes, kind: str) -> ParsedRequest:
    """A request body of /v1/completions (kind "completion") or /v1/chat/completions ("chat"), checked."""
    body = limits.load_json(raw)
    if not isinstance(body, dict):
        raise OpenAIError(f"request body: expected a JSON object, found {type(body).__name__}")
    allowed = _COMPLETION_FIELDS if kind == "completion" else _CHAT_FIELDS
    ignored = tuple(sorted(set(body) - allowed))
    for name, value in body.items():
        check = _TYPES.get(name) if name in allowed else None
        if check is not None and not check[0](value):
            raise OpenAIError(f"{name}: expected {check[1]}, found {json.dumps(value)[:60]}", param=name)
        unsupported = _UNSUPPORTED.get(name) if name in allowed else None
        if unsupported is not None and not unsupported[0](value):
            raise OpenAIError(unsupported[1].format(json.dumps(value)[:60]), param=name, code="unsupported")
    if "model" not in body:
        raise OpenAIError("model: expected a model name, found none", param="model")
    limits.check_numbers({k: v for k, v in body.items() if k in allowed})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                     "repetition_penalty", "seed", "ignore_eos") if body.get(k) is not None}
    sampling.setdefault("temperature", 1.0)        # OpenAI's default
    stops = limits.check_stop(body.get("stop"))
    if stops:
        sampling["stop"] = stops
    options = body.get("stream_options") or {}
    common = dict(kind=kind, model=body["model"], max_tokens=max_tokens, stream=bool(body.get("stream")),
                  include_usage=bool(options.get("include_usage")), sampling=sampling, ignored=ignored,
                  n=body.get("n") or 1, logprobs=_logprobs(body, kind))
    if kind == "completion":
        return ParsedRequest(prompt=_prompt(body.get("prompt")), **common)
    return ParsedRequest(messages=_messages(body.get("messages")), tools=tuple(body.get("tools") or ()),
                         template_kwargs=_template_kwargs(body.get("chat_template_kwargs")), **common)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top tokens a request wants per step, or None for no log-probabilities: chat's `logprobs` is a
    boolean with `top_logprobs` (0..20) beside it; the legacy completions' `logprobs` is that count itself (0..5)."""
    lp = body.get("logprobs")
    if kind == "completion":
        hi = limits.MAX_COMPLETION_LOGPROBS
        if lp is not None and (not _int(lp) or not 0 <= lp <= hi):
            raise OpenAIError(f"logprobs: expected an integer in [0, {hi}] (top tokens per step), found "
                              f"{json.dumps(lp)[:60]}", param="logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise OpenAIError(f"logprobs: expected a boolean (the count goes in top_logprobs), found {json.dumps(lp)[:60]}",
                          param="logprobs")
    top = body.get("top_logprobs")
    if top and not lp:
        raise OpenAIError(f"top_logprobs: expected logprobs: true beside it, found logprobs: {json.dumps(lp)}",
                          param="top_logprobs")
    return (top or 0) if lp else None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: choice 0 samples as a one-choice request would; with a seed, each other choice
    draws from its own seed derived from the request's (so every choice repeats, and none repeats another)."""
    if index == 0 or params.seed is None:
        return params
    digest = hashlib.blake2b(f"{params.seed}/{index}".encode(), digest_size=8).digest()
    return dataclasses.replace(params, seed=int.from_bytes(digest, "big") >> 1)


def _prompt(p) -> str | tuple[int, ...]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                   # a batch of one prompt
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return tuple(p)
    raise OpenAIError(f"prompt: expected a string or a list of token ids, found {json.dumps(p)[:60]}", param="prompt")


def _template_kwargs(kw) -> dict:
    kw = dict(kw or {})
    if len(kw) > limits.MAX_TEMPLATE_KWARGS:
        raise OpenAIError(f"chat_template_kwargs: expected at most {limits.MAX_TEMPLATE_KWARGS} keys, found {len(kw)}",
                          param="chat_template_kwargs")
    clash = sorted(TEMPLATE_OWN & set(kw))
    if clash:
        raise OpenAIError(f"chat_template_kwargs: expected keys other than the template's own variables "
                          f"({', '.join(sorted(TEMPLATE_OWN))}), found {clash[0]!r}", param="chat_template_kwargs")
    bad = [k for k in kw if not k.isidentifier()]
    if bad:
        raise OpenAIError(f"chat_template_kwargs: expected identifiers as keys, found {bad[0][:40]!r}",
                          param="chat_template_kwargs")
    return kw


def _messages(ms) -> tuple:
    if not isinstance(ms, list) or not ms:
        raise OpenAIError(f"messages: expected a non-empty list, found {json.dumps(ms)[:60]}", param="messages")
    if len(ms) > limits.MAX_MESSAGES:
        raise OpenAIError(f"messages: expected at most {limits.MAX_MESSAGES}, found {len(ms)}", param="messages")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIError(f"messages[{i}]: expected an object with a role, found {json.dumps(m)[:60]}", param="messages")
        content = m.get("content")
        if isinstance(content, list):          # content parts: only text ones can reach a text model
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
                raise OpenAIError(f"messages[{i}].content: expected text parts, found {json.dumps(content)[:60]}",
                                  param="messages")
            content = "".join(c["text"] for c in content)
        if content is not None and not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content: expected a string, found {json.dumps(content)[:60]}",
                              param="messages")
        _tool_calls(m.get("tool_calls"), i)
        # transformers drops None-valued keys before rendering (templates test for a key's presence)
        out.append({**{k: v for k, v in m.items() if v is not None}, **({"content": content} if content is not None else {})})
    return tuple(out)


def _tool_calls(calls, i: int) -> None:
    """An assistant message's tool_calls as OpenAI writes them: a list of {"type": "function", "id",
    "function": {"name": str, "arguments": a JSON string or an object}} (templates read every one of these)."""
    if calls is None:
        return
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise OpenAIError(f"{where}: expected a list, found {json.dumps(calls)[:60]}", param="messages")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), (str, dict))
                and isinstance(c.get("id", ""), str) and isinstance(c.get("type", "function"), str)):
            raise OpenAIError(f"{where}[{j}]: expected {{\"type\": \"function\", \"id\": ..., \"function\": "
                              f"{{\"name\": str, \"arguments\": str or object}}}}, found {json.dumps(c)[:80]}",
                              param="messages")

