"""Bounds on what a request may carry, checked before any of it reaches the template, the tokenizer or the engine.

A request body is read in chunks up to MAX_BODY_BYTES (a larger one is refused once that much has come, or at
once from its Content-Length), parsed with non-finite numbers refused, then walked once without recursion:
nesting at most MAX_DEPTH deep, at most MAX_ITEMS values, every string valid Unicode (no lone surrogates, which
no tokenizer or UTF-8 encoder takes). Every refusal is an OpenAIError (a 400 or 413 with OpenAI's error body).
"""
from __future__ import annotations

import json
import math

from helmc.runtime.logprobs import MAX_TOP_LOGPROBS      # chat's top_logprobs (OpenAI's bound)
from helmc.runtime.serve.errors import OpenAIError

MAX_BODY_BYTES = 4 << 20          # a whole context of text is far less; a 50 MB body is refused at 4 MiB
MAX_DEPTH = 32                    # OpenAI's deepest bodies (tools' JSON schemas) nest about ten deep
MAX_ITEMS = 200_000               # values of every kind in one body
MAX_STOP = 8                      # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256              # characters per stop string
MAX_MESSAGES = 4096
MAX_TEMPLATE_KWARGS = 64
MAX_CHOICES = 8                   # n: choices per request, each a sequence of its own in the batch
MAX_COMPLETION_LOGPROBS = 5       # the legacy completions' logprobs (OpenAI's bound)
NUMBER_RANGES = {   # field -> (low, high): what a sampler can use; SamplingParams checks the finer rules
    "temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0), "repetition_penalty": (0.0, 100.0), "top_k": (0, 1 << 31),
    "seed": (0, (1 << 63) - 1), "max_tokens": (1, 1 << 31), "max_completion_tokens": (1, 1 << 31),
    "n": (1, MAX_CHOICES), "top_logprobs": (0, MAX_TOP_LOGPROBS),
}


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body of a Starlette request, refused (413) past `limit` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(f"request body: expected at most {limit} bytes, found {declared} (Content-Length)",
                          status=413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(f"request body: expected at most {limit} bytes, found more", status=413,
                              code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def load_json(raw: bytes):
    """The body as JSON, bounded: a parse error, NaN / Infinity, nesting past MAX_DEPTH (however deep: the C
    parser's own recursion limit is caught too), too many values or a lone surrogate are each a 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise OpenAIError(f"request body: expected JSON nested at most {MAX_DEPTH} deep, found deeper") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body: expected JSON, found a parse error ({e})") from None
    check_tree(body, "request body")
    return body


def check_tree(value, where: str) -> None:
    """Depth, size and strings of a parsed JSON value, walked with an explicit stack."""
    stack, items = [(value, 1)], 0
    while stack:
        v, depth = stack.pop()
        items += 1
        if depth > MAX_DEPTH:
            raise OpenAIError(f"{where}: expected JSON nested at most {MAX_DEPTH} deep, found deeper")
        if items > MAX_ITEMS:
            raise OpenAIError(f"{where}: expected at most {MAX_ITEMS} JSON values, found more")
        if isinstance(v, str):
            _check_string(v, where)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_string(k, where)
                stack.append((x, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise OpenAIError(f"{where}: expected finite numbers, found {v}")


def _check_string(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(f"{where}: expected valid Unicode strings, found a lone surrogate "
                          f"{s[e.start]!r} at character {e.start}") from None


def check_numbers(body: dict) -> None:
    """Each sampling number within NUMBER_RANGES (types were checked before)."""
    for name, (lo, hi) in NUMBER_RANGES.items():
        v = body.get(name)
        if v is not None and not lo <= v <= hi:
            raise OpenAIError(f"{name}: expected a value in [{lo}, {hi}], found {v}", param=name)


def check_stop(stop) -> tuple[str, ...]:
    """Stop strings, bounded in count and length (each one is matched against the text at every step)."""
    if stop is None or stop == []:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP:
        raise OpenAIError(f"stop: expected at most {MAX_STOP} strings, found {len(stops)}", param="stop")
    for s in stops:
        if not s:
            raise OpenAIError("stop: expected non-empty strings, found an empty one", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise OpenAIError(f"stop: expected strings of at most {MAX_STOP_CHARS} characters, found {len(s)}",
                              param="stop")
    return stops
