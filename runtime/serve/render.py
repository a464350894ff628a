"""Chat templates and the tokenizer run in worker processes, never on the server's event loop.

A chat template is code from the model's files: compiling it (jinja2 folds constants: `"x" * 10**10`) or
rendering it can loop or build a huge string. A thread cannot be interrupted, so each worker is a process
(a fresh interpreter: no copy of the loaded model) with a memory limit (RLIMIT_AS) and a time limit per job: a job that
runs past it has its worker killed and replaced, and that request alone gets a 400. The worker dies with
the server (PR_SET_PDEATHSIG). The event loop only waits on a pipe, so /health and every stream go on, and
SIGTERM stops the server whatever a template does.

    pool = RenderPool(template, tokenizer, max_tokens=4096).start()    # template: chat_template.TemplateSource
    ids = await pool.chat(messages, tools, kwargs)                     # or await pool.text(prompt)
    pool.close()
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import helmc
from helmc.runtime.serve.protocol import OpenAIError

TIMEOUT_S = 5.0                   # per job: a real template renders in milliseconds
MEMORY_BYTES = 2 << 30            # a worker's address space (a real tokenizer and template need far less)
MAX_CHARS = 16 << 20              # rendered prompt text


def _main():
    """A worker process: its settings, then jobs, come on stdin; answers go on the original stdout (stdout
    itself is pointed at stderr, so nothing a library prints can break the framing)."""
    from multiprocessing.connection import Connection
    _die_with_parent()
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    reader, writer = Connection(rfd, writable=False), Connection(wfd, readable=False)
    try:
        args = reader.recv()
    except (EOFError, OSError):
        return
    _worker(reader, writer, *args)


def _worker(reader, writer, source, special_tokens, tokenizer_json, max_chars, max_tokens, memory_bytes):
    """A worker's loop: (kind, args) jobs in, ("ok", ids) or ("bad", message) out."""
    if memory_bytes:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    tokenizer = template = template_error = None
    if tokenizer_json is not None:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_str(tokenizer_json)
    while True:
        try:
            kind, args = reader.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "chat" and template is None and template_error is None:
                template, template_error = _compile(source, special_tokens)
            out = _job(kind, args, template, template_error, tokenizer, max_chars, max_tokens)
        except MemoryError:
            out = ("bad", f"{'chat template' if kind == 'chat' else 'prompt'}: ran out of the renderer's "
                          f"{memory_bytes >> 20} MiB of memory")
        except Exception as e:                    # what a template or the tokenizer raises: this request's error
            out = ("bad", f"{'chat template' if kind == 'chat' else 'prompt'}: {type(e).__name__}: {e}"[:500])
        writer.send(out)


def _compile(source, special_tokens):
    from helmc.errors import HelmcError
    from helmc.runtime.serve.chat_template import ChatTemplate
    if source is None:
        return None, "this model has no chat template (tokenizer_config.json / chat_template.jinja); use /v1/completions"
    try:
        return ChatTemplate(source, special_tokens), None
    except HelmcError as e:
        return None, str(e)


def _job(kind, args, template, template_error, tokenizer, max_chars, max_tokens):
    if kind == "probe":
        error = _compile(*args)[1]
        return ("ok", None) if error is None else ("bad", error)
    if kind == "chat":
        if template is None:
            return "bad", template_error
        messages, tools, kwargs = args
        text = template.render(list(messages), add_generation_prompt=True, tools=tools or None, **kwargs)
        special = False                           # the template wrote the special tokens
    else:
        text, special = args, True                # as `helmc run --prompt` encodes
    if len(text) > max_chars:
        return "bad", f"prompt: expected at most {max_chars} characters of text, found {len(text)}"
    if tokenizer is None:
        return "bad", "this bundle has no tokenizer: send the prompt as token ids"
    ids = tokenizer.encode(text, add_special_tokens=special).ids
    return "ok", tuple(ids[:max_tokens + 1])      # one past the limit is enough for the context check


def _die_with_parent():
    try:
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Worker:
    """One worker process (a fresh interpreter: `python -c`, so it never re-runs the server's own entry point)
    and its two pipes."""

    def __init__(self, args):
        self.args = args
        self.start()

    def start(self):
        from multiprocessing.connection import Connection
        root = os.path.dirname(os.path.dirname(os.path.abspath(helmc.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", "from helmc.runtime.serve.render import _main; _main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.writer = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.reader = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.writer.send(self.args)

    def kill(self):
        self.proc.kill()
        self.proc.wait(5)
        self.writer.close()
        self.reader.close()

    def call(self, job, timeout: float):
        """Runs on an executor thread: the job's answer, or the worker replaced after a timeout or a crash."""
        try:
            self.writer.send(job)
            if self.reader.poll(timeout):
                return self.reader.recv()
            reason = f"ran past the renderer's {timeout:g} s"
        except (EOFError, OSError, BrokenPipeError):
            reason = f"ended its renderer (exit code {self.proc.poll()})"
        self.kill()
        self.start()
        return "bad", reason


class RenderPool:
    def __init__(self, template, tokenizer, max_tokens: int, workers: int = 2, timeout_s: float = TIMEOUT_S,
                 memory_bytes: int = MEMORY_BYTES, max_chars: int = MAX_CHARS):
        """template: a chat_template.TemplateSource or None; tokenizer: a tokenizers.Tokenizer or None;
        max_tokens: the context (longer prompts are cut one past it, for the scheduler's refusal); workers: for
        chat templates, besides one for text prompts (so a template that runs long never holds up completions)."""
        self.template = template
        self.args = (template.source if template else None, template.special_tokens if template else {},
                     tokenizer.to_str() if tokenizer is not None else None, max_chars, max_tokens, memory_bytes)
        self.n, self.timeout = workers, timeout_s
        self.workers: list[_Worker] = []
        self.template_error: str | None = None
        self._idle: dict[str, asyncio.Queue] = {}

    def start(self) -> "RenderPool":
        self.workers = [_Worker(self.args) for _ in range(self.n + 1)]     # the last: text prompts
        return self

    def check_template(self) -> str | None:
        """Compile the template once in a worker (bounded like any job): None if it compiles, else why not
        (chat requests then get that reason as a 400)."""
        if self.template is None:
            return None
        status, answer = self.workers[0].call(("probe", (self.template.source, self.template.special_tokens)),
                                              self.timeout)
        self.template_error = None if status == "ok" else f"chat template refused: {answer}"
        return self.template_error

    async def chat(self, messages, tools, kwargs) -> tuple[int, ...]:
        if self.template is None:
            raise OpenAIError("this model has no chat template (tokenizer_config.json / chat_template.jinja); "
                              "use /v1/completions", param="messages")
        if self.template_error:
            raise OpenAIError(self.template_error, param="messages")
        return await self._run(("chat", (tuple(messages), tuple(tools), dict(kwargs))), "messages")

    async def text(self, prompt: str) -> tuple[int, ...]:
        return await self._run(("text", prompt), "prompt")

    async def _run(self, job, param: str) -> tuple[int, ...]:
        loop = asyncio.get_running_loop()
        if not self._idle:
            self._idle = {"chat": asyncio.Queue(), "text": asyncio.Queue()}
            for w in self.workers[:-1]:
                self._idle["chat"].put_nowait(w)
            self._idle["text"].put_nowait(self.workers[-1])
        idle = self._idle["chat" if job[0] == "chat" else "text"]
        w = await idle.get()
        fut = loop.run_in_executor(None, w.call, job, self.timeout)
        fut.add_done_callback(lambda _: idle.put_nowait(w))     # back only once its job is over
        status, out = await asyncio.shield(fut)
        if status != "ok":
            known = out.startswith(("chat template", "prompt", "this bundle"))
            raise OpenAIError(out if known else f"{'chat template' if param == 'messages' else 'prompt'}: {out}",
                              param=param)
        if not out:
            raise OpenAIError("prompt: expected at least one token, found none", param="prompt")
        return out

    def close(self) -> None:
        for w in self.workers:
            w.kill()


def overhead_ms(pool: RenderPool, n: int = 200) -> float:
    """Mean milliseconds of a worker round trip for a one-word prompt (what the process boundary costs)."""
    async def go():
        t0 = time.perf_counter()
        for _ in range(n):
            await pool.text("hello")
        return (time.perf_counter() - t0) * 1000 / n
    return asyncio.run(go())

