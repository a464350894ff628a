"""The engine: one thread owns the model (TVM and the KV caches are not thread-safe) and runs the steps.

Each step: take new requests and cancellations from the inbox; admit what the scheduler lets in (a free slot
and the pages), prefill the new requests in their slots, together (BatchModel.prefill_many: their chunks share
the CPU stage's block calls, so the last of several does not wait for the others' prefills one by one; each
one's logits as its prefill alone), and sample each one's first token; then one batched decode step for every
running request; sample each row with the request's own Sampler (and, for a request that asked for
log-probabilities, read them from that same row: runtime/logprobs.py); send each request its
CompletionChunk through its sink (a callable, called on the engine thread: the server hands it to its event
loop). A request ends at EOS (generation_config.json's, else the model spec's), a stop string, max_tokens,
or cancellation (a client that went away): its slot's pages go back at once. Whatever fails in one request's
sampling, stop check or text ends that request alone with finish_reason "error"; the others go on.

    eng = Engine(batch_model, tokenizer, eos_ids)
    eng.start()                                    # the engine thread
    eng.submit(request, sink)                      # OpenAIError if it can never fit
    eng.cancel(request.request_id)
    eng.stop()
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from helmc.errors import HelmcError
from helmc.runtime.logprobs import StepLogprobs, TokenPieces, token_logprob
from helmc.runtime.sampling import Sampler, StopText
from helmc.runtime.serve.protocol import CompletionChunk, Request
from helmc.runtime.serve.scheduler import Scheduler

# Fault injection for the reliability tests, as HELMC_FAULT_ALLOC: a request with this seed fails at its third token.
_FAULT_SEED = int(os.environ["HELMC_FAULT_SEQUENCE_SEED"]) if os.environ.get("HELMC_FAULT_SEQUENCE_SEED") else None


@dataclass
class _Running:
    req: Request
    slot: int
    sink: Callable[[CompletionChunk], None]
    sampler: Sampler | None
    text: StopText | None
    t_submit: float
    t_first: float = 0.0
    tokens: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, model, tokenizer, eos_ids, metrics=None, pool_pages: int | None = None,
                 batch_prefill: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.pieces = TokenPieces(tokenizer)                     # token texts for log-probabilities, once per id
        self.eos = frozenset(int(t) for t in eos_ids)
        self.metrics = metrics
        self.scheduler = Scheduler(model.max_batch, model.page_tokens, model.max_context, pool_pages)
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[Callable, float]] = {}     # waiting request -> (sink, submit time)
        self._running: dict[str, _Running] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.batch_prefill = batch_prefill                       # False: newcomers' prefills one after another
        self.steps = 0
        self.decode_rows = 0                                     # sequences decoded, summed over steps

    # ------------------------------------------------------------------ any thread
    def submit(self, req: Request, sink: Callable[[CompletionChunk], None]) -> None:
        self.scheduler.check(req)                                # raises for a request that can never fit
        self._inbox.put(("submit", req, sink, time.perf_counter()))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="helmc-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ engine thread
    def _loop(self):
        while not self._stop.is_set():
            try:
                self.step(block=True)
            except Exception as e:          # a model step failed: no request can go on, fail what runs
                print(f"helmc serve: engine step failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                for rid in list(self._running):
                    self._finish(rid, "error", error=f"{type(e).__name__}: {e}")

    def step(self, block: bool = False) -> None:
        """One scheduling step (the thread's loop, or a caller driving the engine itself, e.g. helmc chat)."""
        self._drain(block and self.scheduler.idle)
        new = []
        for req, slot in self.scheduler.admit():
            sink, t_submit = self._sinks.pop(req.request_id)
            r = _Running(req, slot, sink, None, None, t_submit)
            self._running[req.request_id] = r
            try:
                r.sampler, r.text = Sampler(req.params, req.prompt_ids), StopText(self.tokenizer, req.params.stop)
            except Exception as e:
                self._fail(r, e)
                continue
            new.append(r)
        self._prefill(new)
        batch = list(self._running.values())
        if self.metrics:
            self.metrics.queue.set(len(self.scheduler.waiting))
            self.metrics.running.set(len(batch))
        if not batch:
            return
        logits = self.model.decode([r.slot for r in batch], [r.tokens[-1] for r in batch])
        self.steps += 1
        self.decode_rows += len(batch)
        for r, row in zip(batch, logits):
            self._sample(r, row)

    def _prefill(self, new: list[_Running]) -> None:
        """Prompts of the newly admitted requests into their slots, then each one's first token. A batched prefill
        that fails (one request's error) is undone and retried one request at a time, so only that one fails."""
        if len(new) > 1 and self.batch_prefill:
            try:
                logits = self.model.prefill_many([(r.slot, list(r.req.prompt_ids)) for r in new])
            except Exception:
                for r in new:
                    self.model.free(r.slot)
            else:
                for r, row in zip(new, logits):
                    self._first(r, row)
                return
        for r in new:
            try:
                logits = self.model.prefill(r.slot, list(r.req.prompt_ids))
            except Exception as e:
                self._fail(r, e)
                continue
            self._first(r, logits)

    def _first(self, r: _Running, logits) -> None:
        r.t_first = time.perf_counter()
        if self.metrics:
            self.metrics.ttft.observe(r.t_first - r.t_submit)
        self._sample(r, logits)

    def _sample(self, r: _Running, logits) -> None:
        """One request's next token, its stop checks and text: whatever fails there ends that request alone."""
        try:
            if _FAULT_SEED is not None and r.req.params.seed == _FAULT_SEED and len(r.tokens) == 2:
                raise RuntimeError("injected fault (HELMC_FAULT_SEQUENCE_SEED)")
            tok = r.sampler(logits)
            lp = None if r.req.logprobs is None else self.pieces.name(token_logprob(logits, tok, r.req.logprobs))
            self._accept(r, tok, lp)
        except Exception as e:
            if r.req.request_id in self._running:
                self._fail(r, e)

    def _fail(self, r: _Running, e: Exception) -> None:
        print(f"helmc serve: request {r.req.request_id} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        self._finish(r.req.request_id, "error", error=str(e) if isinstance(e, HelmcError) else f"{type(e).__name__}: {e}")

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg[0] == "submit":
                _, req, sink, t = msg
                self._sinks[req.request_id] = (sink, t)
                self.scheduler.submit(req)
            elif msg[0] == "cancel":
                rid = msg[1]
                if rid in self._running:
                    self._finish(rid, None)
                elif rid in self._sinks:
                    del self._sinks[rid]
                    self.scheduler.finish(rid)

    def _accept(self, r: _Running, tok: int, lp: StepLogprobs | None) -> None:
        r.tokens.append(tok)
        lps = () if lp is None else (lp,)
        eos = tok in self.eos and not r.req.params.ignore_eos
        delta = r.text.flush() if eos else r.text.add(tok)       # EOS is no text: release what was held back
        if eos or r.text.stopped:
            reason = "stop"
        elif len(r.tokens) >= r.req.params.max_tokens:
            reason, delta = "length", delta + r.text.flush()
        else:
            r.sink(CompletionChunk(r.req.request_id, (tok,), delta, logprobs=lps))
            return
        self._finish(r.req.request_id, reason, last=((tok,), delta, lps))

    def _finish(self, rid: str, reason: str | None, last=((), "", ()), error: str = "") -> None:
        """Slot and pages back at once; the client gets its last chunk (none when it cancelled)."""
        r = self._running.pop(rid)
        self.model.free(r.slot)
        self.scheduler.finish(rid)
        if self.metrics and reason is not None:
            t = time.perf_counter()
            self.metrics.finished(reason, len(r.tokens), r.t_first, t)
        if reason is not None:
            try:
                r.sink(CompletionChunk(rid, last[0], last[1], reason, len(r.req.prompt_ids), len(r.tokens), error,
                                       last[2]))
            except Exception as e:       # a sink that fails (its client gone) is that request's end, nobody else's
                print(f"helmc serve: request {rid}: its last chunk was not delivered ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)

