"""Who runs: continuous batching bookkeeping in pure Python (no model, no threads), so it is tested with exact ids.

Requests wait in arrival order. A request is admitted when a batch slot is free and the KV pool has the
pages for its whole context (prompt + max_tokens, in whole pages); it keeps both until it finishes or is
cancelled, then both go back at once. Admission is first come, first served: a request that does not fit
yet blocks those behind it, so none waits forever. A request that could never fit (more context than one
slot holds, or more pages than the pool has) is refused at submit with the reason.

    s = Scheduler(max_batch=2, page_tokens=16, slot_tokens=64)
    s.submit(req)                  # OpenAIError if it can never fit
    for req, slot in s.admit(): ...
    s.finish(req.request_id)       # slot and pages free again
"""
from __future__ import annotations

from collections import deque

from helmc.errors import HelmcError
from helmc.runtime.serve.protocol import OpenAIError, Request


class Scheduler:
    def __init__(self, max_batch: int, page_tokens: int, slot_tokens: int, pool_pages: int | None = None):
        """slot_tokens: the context one slot's KV cache holds (the plan's max_context); pool_pages: pages of the
        whole KV pool (default: every slot full)."""
        if min(max_batch, page_tokens, slot_tokens) < 1:
            raise HelmcError(f"scheduler: expected max_batch, page_tokens and slot_tokens >= 1, found "
                             f"{max_batch}, {page_tokens}, {slot_tokens}")
        self.max_batch, self.page_tokens, self.slot_tokens = max_batch, page_tokens, slot_tokens
        self.pool_pages = max_batch * self.pages_for(slot_tokens) if pool_pages is None else pool_pages
        self.waiting: deque[Request] = deque()
        self.running: dict[str, int] = {}          # request_id -> slot
        self._pages: dict[str, int] = {}           # request_id -> pages held
        self._free_slots = list(range(max_batch))
        self._used = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    @property
    def pages_in_use(self) -> int:
        return self._used       # a count, not a sum over _pages: other threads read it (/health, /metrics)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, req: Request) -> None:
        if req.request_id in self.running or any(r.request_id == req.request_id for r in self.waiting):
            raise HelmcError(f"scheduler: request id {req.request_id} is already queued")
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """Refuse a request that could never fit (reads only the limits: callable from any thread)."""
        n = len(req.prompt_ids)
        if n >= self.slot_tokens:
            raise OpenAIError(f"prompt: expected at most {self.slot_tokens - 1} tokens (the context is {self.slot_tokens}), "
                              f"found {n}", param="messages", code="context_length_exceeded")
        if req.tokens > self.slot_tokens:
            raise OpenAIError(f"max_tokens: the prompt's {n} tokens and max_tokens {req.params.max_tokens} need "
                              f"{req.tokens} tokens of context, this model's is {self.slot_tokens}",
                              param="max_tokens", code="context_length_exceeded")
        if self.pages_for(req.tokens) > self.pool_pages:
            raise OpenAIError(f"max_tokens: {req.tokens} tokens need {self.pages_for(req.tokens)} KV pages, the pool "
                              f"has {self.pool_pages}", param="max_tokens", code="context_length_exceeded")

    def admit(self) -> list[tuple[Request, int]]:
        """Requests that start now, each with its slot (lowest free first)."""
        out = []
        while self.waiting and self._free_slots:
            need = self.pages_for(self.waiting[0].tokens)
            if self.pages_in_use + need > self.pool_pages:
                break
            req = self.waiting.popleft()
            slot = self._free_slots.pop(self._free_slots.index(min(self._free_slots)))
            self.running[req.request_id] = slot
            self._pages[req.request_id] = need
            self._used += need
            out.append((req, slot))
        return out

    def finish(self, request_id: str) -> int | None:
        """A request is done or cancelled: its slot (None if it was still waiting, or unknown) and pages go back."""
        if request_id in self.running:
            slot = self.running.pop(request_id)
            self._used -= self._pages.pop(request_id)
            self._free_slots.append(slot)
            return slot
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        return None
