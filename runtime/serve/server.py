"""The OpenAI-compatible HTTP side (Starlette on uvicorn): it parses, renders the chat template, tokenizes, and
talks to the engine thread through queues; it never touches the model.

    GET  /health  /metrics  /v1/models
    POST /v1/completions  /v1/chat/completions      (stream: server-sent events in OpenAI's chunk format)

A request for n choices is n engine requests (n sequences batched like any others), answered as choices 0..n-1.
A refused request gets a 4xx with OpenAI's error body and one line in the log, and the server goes on serving.
Bodies are bounded (limits.py) and read in chunks; chat templates and the tokenizer run in worker processes
(render.py), so nothing a request carries runs on the event loop. A client that goes away, streaming or not,
cancels its request: the engine frees its slot and pages at its next step.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

from helmc.runtime.serve.limits import read_body
from helmc.runtime.serve.protocol import (CompletionChunk, OpenAIError, ParsedRequest, Request, choice_params,
                                          parse_body)
from helmc.runtime.serve.responses import Choice, ResponseFormat

_ids = itertools.count()
log = logging.getLogger("uvicorn.error")      # uvicorn configures it: one line per refused request


class ServeState:
    """What the handlers share: the engine, the model's name, the render workers (chat template and tokenizer),
    the metrics."""

    def __init__(self, engine, model_name: str, renderer, metrics, vocab_size: int):
        self.engine, self.model_name, self.renderer = engine, model_name, renderer
        self.metrics, self.vocab_size = metrics, vocab_size
        self.created = int(time.time())

    async def prompt_ids(self, p: ParsedRequest) -> tuple[int, ...]:
        if p.kind == "chat":
            return await self.renderer.chat(p.messages, p.tools, p.template_kwargs)
        if isinstance(p.prompt, tuple):
            bad = [t for t in p.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise OpenAIError(f"prompt: token ids expected in [0, {self.vocab_size}), found {bad[:3]}", param="prompt")
            return p.prompt
        return await self.renderer.text(p.prompt)


def make_app(state: ServeState):
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def health(request):
        eng = state.engine           # read across threads: plain counts, good enough for a health probe
        return JSONResponse({"status": "ok", "running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
                             "kv_pages_in_use": eng.model.pages_in_use(), "kv_pages_reserved": eng.scheduler.pages_in_use})

    async def metrics(request):
        body, ctype = state.metrics.text()
        return Response(body, media_type=ctype)

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "helmc"}]})

    def endpoint(kind: str, name: str):
        async def handler(request):
            try:
                response = await _generate(state, request, kind)
            except ClientDisconnect:                 # gone while sending its body: nobody to answer
                response = Response(status_code=499)
            except asyncio.CancelledError:           # the server stops (SIGTERM) while this request waits
                err = OpenAIError("the server is shutting down", status=503, type="server_error")
                response = JSONResponse(err.body(), status_code=503)
            except OpenAIError as e:
                log.warning("%s %s: %s", e.status, request.url.path, e.message)
                response = JSONResponse(e.body(), status_code=e.status)
            except Exception as e:                   # a bug: one line in the log, OpenAI's body to the client
                log.error("500 %s: %s: %s", request.url.path, type(e).__name__, e)
                err = OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error")
                response = JSONResponse(err.body(), status_code=500)
            state.metrics.requests.labels(name, str(response.status_code)).inc()
            return response
        return handler

    routes = [Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
              Route("/v1/completions", endpoint("completion", "completions"), methods=["POST"]),
              Route("/v1/chat/completions", endpoint("chat", "chat_completions"), methods=["POST"])]
    return Starlette(routes=routes)


async def _generate(state: ServeState, request, kind: str):
    from starlette.responses import JSONResponse, Response
    p = parse_body(await read_body(request), kind)
    if p.model != state.model_name:
        raise OpenAIError(f"model: expected {state.model_name!r}, found {p.model!r}", status=404, param="model",
                          code="model_not_found")
    ids = await state.prompt_ids(p)
    room = state.engine.model.max_context - len(ids)
    max_tokens = p.max_tokens or (16 if kind == "completion" else max(1, room))     # OpenAI's default, or the context
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{next(_ids)}-{int(time.time() * 1e3)}"
    params = p.sampling_params(max_tokens)
    # n choices are n sequences: each its own Request (and slot), batched with the others like any request
    reqs = [Request(rid if p.n == 1 else f"{rid}-{i}", ids, choice_params(params, i), p.logprobs) for i in range(p.n)]
    chunks: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def cancel():
        for r in reqs:
            state.engine.cancel(r.request_id)

    def sink_of(index: int):
        def sink(chunk: CompletionChunk):       # on the engine thread
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, (index, chunk))
            except RuntimeError:                 # the event loop is gone: nobody is listening
                cancel()
        return sink

    try:
        for i, r in enumerate(reqs):             # every choice fits, or the first is refused: the same prompt and size
            state.engine.submit(r, sink_of(i))
    except OpenAIError as e:
        if e.param == "messages" and kind == "completion":
            e.param = "prompt"
        raise
    fmt = ResponseFormat(kind, rid, state.model_name, p.logprobs is not None)
    headers = {"Warning": f'299 - "ignored unknown fields: {", ".join(p.ignored)}"'} if p.ignored else {}
    if p.ignored:
        log.warning("%s: ignored unknown fields %s", request.url.path, ", ".join(p.ignored))
    if p.stream:
        return _EngineStream(_sse(fmt, chunks, p.n, p.include_usage), on_close=cancel, headers=headers)
    choices = await _collect(request, chunks, p.n, cancel)
    if choices is None:                          # the client went away: its request was cancelled at once
        return Response(status_code=499)
    failed = next((c.last for c in choices if c.last is not None and c.last.finish_reason == "error"), None)
    if failed is not None:
        raise OpenAIError(f"generation failed: {failed.error}", status=500, type="server_error")
    return JSONResponse(fmt.whole(choices), headers=headers)


async def _collect(request, chunks: asyncio.Queue, n: int, cancel) -> list[Choice] | None:
    """A non-streamed request's chunks until each choice's last, or None as soon as its client disconnects
    (the engine then frees the slots and pages at its next step, as for a stream)."""
    async def gone():
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:                        # no way to listen: the generation's end decides
            await asyncio.Event().wait()

    async def collect():
        choices, left = [Choice() for _ in range(n)], n
        while left:
            i, c = await chunks.get()
            choices[i].add(c)
            left -= c.finish_reason is not None
            if c.finish_reason == "error":       # one choice failed: the response is an error, the rest stop
                cancel()
                break
        return choices

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
    done = set()
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if work not in done:
            work.cancel()
            cancel()
    return work.result() if work in done else None


async def _sse(fmt: ResponseFormat, chunks: asyncio.Queue, n: int, include_usage: bool):
    choices = [Choice() for _ in range(n)]
    if fmt.kind == "chat":
        for i in range(n):
            yield _event(fmt.chunk(i, {"role": "assistant", "content": ""}, None))
    left = n
    while left:
        i, c = await chunks.get()
        if c.finish_reason == "error":
            yield _event({"error": {"message": f"generation failed: {c.error}", "type": "server_error",
                                    "param": None, "code": None}})
            break
        choices[i].add(c)
        for obj in fmt.streamed(i, choices[i], c):
            yield _event(obj)
        left -= c.finish_reason is not None
    else:
        if include_usage:
            yield _event(fmt.usage_chunk(choices))
    yield "data: [DONE]\n\n"


def _event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _EngineStream(body, on_close, headers=None):
    """A text/event-stream response that listens for the client going away whatever the ASGI version (Starlette
    only does below 2.4) and always calls on_close when it ends (cancelling a request that already finished is
    a no-op in the engine)."""
    import anyio
    from starlette.responses import StreamingResponse

    class EngineStream(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                async with anyio.create_task_group() as tg:
                    async def run():
                        try:
                            await self.stream_response(send)
                        except OSError:             # the client went away while we wrote
                            pass
                        tg.cancel_scope.cancel()
                    tg.start_soon(run)
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()
            finally:
                on_close()

    return EngineStream(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})


def bind(host: str, port: int):
    """The listening socket, bound before the model loads: a busy port is a one-line HelmcError at once (clients
    that connect while the model loads wait in the backlog)."""
    import socket
    from helmc.errors import HelmcError
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)        # listening now: a second server's bind fails even with SO_REUSEADDR
    except OSError as e:
        sock.close()
        raise HelmcError(f"--host {host} --port {port}: expected a free address to listen on, found it "
                         f"{'in use' if e.errno == 98 else 'refused'} ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def serve(state: ServeState, sock, log_level: str = "warning", ready=None) -> None:
    """Run uvicorn on the bound socket `sock` until interrupted; `ready(port)` is called once it listens."""
    import uvicorn
    config = uvicorn.Config(make_app(state), log_level=log_level, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    if ready is not None:
        _orig = server.startup

        async def startup(sockets=None):
            await _orig(sockets)
            ready(sock.getsockname()[1])
        server.startup = startup
    server.run(sockets=[sock])
