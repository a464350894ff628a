"""The VRAM expert cache of a GPU stage's mixture-of-experts block: which routed experts hold the block's VRAM slots,
refreshed at run time from the experts its tokens select.

The plan fixes how many slots a block has and which experts start in them (Plan.placement.gpu_experts: the
routing statistics' hottest) and whether the cache runs (Plan.placement.expert_cache). As decode goes, each block
keeps a decayed selection count per expert (fed by the decode row's host half and the batched step with the
experts every token selected); every `refresh_tokens` tokens it decides: the hottest host expert replaces the
coldest slot's expert when its count beats that one's by more than `margin`, at most `max_promotions` a refresh.

ExpertResidency is that bookkeeping alone (NumPy; tested on the CPU with exact ids). VramExpertCache is its GPU
side: a promotion copies the expert's (gate, up, down) rows from the host's stacked tensors into the slot's rows of
the block's stacked VRAM tensors on a copy stream, and the slot serves the expert only once the copy's event has
completed (polled at the block's next token: a token never waits on a copy). Slot addresses never change, so the
captured CUDA graphs that read the slots stay valid.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError


@dataclass(frozen=True)
class ExpertCacheOptions:
    """How the cache refreshes (the defaults, defined here once). enabled: the off switch (Plan.placement.expert_cache
    turns it on for a session)."""
    enabled: bool = True
    refresh_tokens: int = 16     # a block decides every this many tokens (rows) it routes
    decay: float = 0.5           # every count is multiplied by this after each decision
    margin: float = 2.0          # a host expert replaces a slot's expert only when its count is larger by more than this
    max_promotions: int = 1      # per block per refresh

    def __post_init__(self):
        if self.refresh_tokens < 1:
            raise HelmcError(f"expert cache: refresh_tokens expected >= 1, found {self.refresh_tokens}")
        if not 0.0 <= self.decay <= 1.0:
            raise HelmcError(f"expert cache: decay expected 0..1, found {self.decay}")
        if self.margin < 0.0:
            raise HelmcError(f"expert cache: margin expected >= 0, found {self.margin}")
        if self.max_promotions < 0:
            raise HelmcError(f"expert cache: max_promotions expected >= 0, found {self.max_promotions}")


class ExpertResidency:
    """One block's VRAM slots and who holds them. Invariants (check(), after every mutator):
      - slot_expert[s] is the expert slot s serves, or -1 while its rows are being copied (incoming[s] is then the
        expert arriving); slot_of[e] is expert e's serving slot, or -1: e runs on the CPU;
      - slot_of and slot_expert are inverse: slot_of[slot_expert[s]] == s for every serving slot s, and
        slot_expert[slot_of[e]] == e for every expert e in VRAM;
      - a slot holds one expert (serving or incoming), an expert sits in at most one slot;
      - an expert mid-copy is served by the CPU: slot_of[incoming[s]] == -1.
    slot_of is one array, changed in place: the decode row's BlockRow, the batched step and prefill read it."""

    def __init__(self, num_experts: int, initial, options: ExpertCacheOptions = ExpertCacheOptions()):
        initial = [int(e) for e in initial]
        if len(set(initial)) != len(initial) or any(not 0 <= e < num_experts for e in initial):
            raise HelmcError(f"expert cache: initial slots expected distinct experts in 0..{num_experts - 1}, "
                             f"found {initial[:16]}")
        self.options = options
        self.num_experts = num_experts
        self.slot_expert = np.array(initial, np.int32).reshape(-1)      # [slots]
        self.incoming = np.full(len(initial), -1, np.int32)             # [slots]
        self.slot_of = np.full(num_experts, -1, np.int32)               # [E]
        self.slot_of[self.slot_expert] = np.arange(len(initial), dtype=np.int32)
        self.counts = np.zeros(num_experts, np.float64)                 # decayed selections per expert
        self.selected = np.zeros(num_experts, np.int64)                 # every selection per expert, never decayed
        self.tokens = 0                       # rows routed since the last decision
        self.selections = self.hits = 0       # (row, expert) pairs observed, those served from VRAM
        self.promotions = 0                   # copies completed
        self.check()

    @property
    def slots(self) -> int:
        return len(self.slot_expert)

    def check(self) -> None:
        serving = np.flatnonzero(self.slot_expert >= 0)
        resident = np.flatnonzero(self.slot_of >= 0)
        assert np.array_equal(self.slot_of[self.slot_expert[serving]], serving), "a serving slot's expert is elsewhere"
        assert np.array_equal(self.slot_expert[self.slot_of[resident]], resident), "an expert's slot serves another"
        busy = self.incoming >= 0
        assert not (busy & (self.slot_expert >= 0)).any(), "a slot holds two experts"
        held = np.concatenate([self.slot_expert[serving], self.incoming[busy]])
        assert len(set(held.tolist())) == held.size, "an expert sits in two slots"
        assert (self.slot_of[self.incoming[busy]] == -1).all(), "an expert mid-copy is served from VRAM"

    def resident(self) -> frozenset:
        """The experts VRAM serves now."""
        return frozenset(int(e) for e in self.slot_expert if e >= 0)

    def in_flight(self) -> list[int]:
        """The slots whose rows are being copied."""
        return [int(s) for s in np.flatnonzero(self.incoming >= 0)]

    def hit_rate(self) -> float:
        return self.hits / self.selections if self.selections else 0.0

    # ------------------------------------------------------------------ counting
    def observe(self, idx) -> None:
        """The experts a step's rows selected (idx [rows, k], route's): counts, tokens, hits (served from VRAM now)."""
        idx = np.asarray(idx)
        flat = idx.reshape(-1)
        rows = idx.shape[0] if idx.ndim > 1 else 1
        if rows == 1:           # one row's top-k are distinct: an indexed add (a decode token, every block)
            self.selected[flat] += 1
        else:
            np.add.at(self.selected, flat, 1)
        if self.options.enabled:
            if rows == 1:
                self.counts[flat] += 1.0
            else:
                np.add.at(self.counts, flat, 1.0)
            self.tokens += rows
        self.selections += flat.size
        self.hits += int(np.count_nonzero(self.slot_of[flat] >= 0))

    def forget(self) -> None:
        """Drop what has been counted (a warm-up's dummy tokens: requests do not depend on it); the slots stay."""
        self.counts[:] = 0.0
        self.selected[:] = 0
        self.tokens = self.selections = self.hits = 0

    def due(self) -> bool:
        return self.options.enabled and self.slots > 0 and self.tokens >= self.options.refresh_tokens

    # ------------------------------------------------------------------ deciding
    def decide(self) -> list[tuple[int, int]]:
        """This refresh's promotions [(slot, expert)]: host experts hottest first (ties: the lower id) against serving
        slots coldest first (ties: the lower slot), while the host expert's count beats the slot's by more than the
        margin (equal counts never swap: no thrash), at most max_promotions. Then the counts decay and the token
        count restarts. Decides only: begin() starts each promotion."""
        o = self.options
        host = self.slot_of < 0
        host[self.incoming[self.incoming >= 0]] = False
        hosts = np.flatnonzero(host)
        hosts = hosts[np.argsort(-self.counts[hosts], kind="stable")][:o.max_promotions]   # ids ascending on ties
        colds = np.flatnonzero(self.slot_expert >= 0)
        colds = colds[np.argsort(self.counts[self.slot_expert[colds]], kind="stable")][:o.max_promotions]
        out = []
        for hot, cold in zip(hosts.tolist(), colds.tolist()):
            if not self.counts[hot] > self.counts[self.slot_expert[cold]] + o.margin:
                break
            out.append((cold, hot))
        self.counts *= o.decay
        self.tokens = 0
        return out

    # ------------------------------------------------------------------ moving
    def begin(self, slot: int, expert: int) -> None:
        """Slot `slot` starts receiving `expert`'s rows: its expert goes back to the CPU now, `expert` stays there
        until complete()."""
        assert self.slot_expert[slot] >= 0, f"slot {slot} is already receiving expert {self.incoming[slot]}"
        assert self.slot_of[expert] < 0 and expert not in self.incoming, f"expert {expert} is already in VRAM"
        self.slot_of[self.slot_expert[slot]] = -1
        self.slot_expert[slot] = -1
        self.incoming[slot] = expert
        self.check()

    def complete(self, slot: int) -> None:
        """Slot `slot`'s copy is done: it serves its incoming expert from now on."""
        e = int(self.incoming[slot])
        assert e >= 0, f"slot {slot} is receiving no expert"
        self.incoming[slot] = -1
        self.slot_expert[slot] = e
        self.slot_of[e] = slot
        self.promotions += 1
        self.check()


class VramExpertCache:
    """ExpertResidency's copies for one block: the host's stacked expert tensors (every expert's rows written) and
    the block's stacked VRAM tensors, (gate, up, down) each [experts * rows, row bytes] and [slots * rows, row bytes].
    step() at each of the block's tokens, before its selected experts are split between the devices."""

    def __init__(self, residency: ExpertResidency, host_stacked: tuple, vram_stacked: tuple, copy_stream):
        self.residency = residency
        self.copy_stream = copy_stream
        E = residency.num_experts
        self._sources = [(np.from_dlpack(t).ctypes.data, _rows_bytes(t, E)) for t in host_stacked]
        self._targets = [(_device_ptr(t), _rows_bytes(t, residency.slots)) for t in vram_stacked]
        for (_, a), (_, b) in zip(self._sources, self._targets):
            assert a == b, f"an expert's host rows ({a} bytes) differ from its VRAM slot's ({b})"
        self._copies: dict[int, object] = {}      # slot -> the event after its copy

    def step(self) -> None:
        """Slots whose copy completed serve their experts; then, when the residency is due, its promotions start:
        the old experts' readers queued so far (the current stream) finish before their rows are overwritten."""
        import cupy as cp
        for slot, done in list(self._copies.items()):
            if done.done:
                self.residency.complete(slot)
                del self._copies[slot]
        if not self.residency.due():
            return
        moves = self.residency.decide()
        if not moves:
            return
        readers = cp.cuda.Event(disable_timing=True)
        readers.record(cp.cuda.get_current_stream())
        self.copy_stream.wait_event(readers)
        for slot, e in moves:
            self.residency.begin(slot, e)
            for (src, n), (dst, _) in zip(self._sources, self._targets):
                cp.cuda.runtime.memcpyAsync(dst + slot * n, src + e * n, n, cp.cuda.runtime.memcpyHostToDevice,
                                            self.copy_stream.ptr)
            done = cp.cuda.Event(disable_timing=True)
            done.record(self.copy_stream)
            self._copies[slot] = done


def forget_counts(session) -> None:
    """Every residency of a session's GPU stage forgets its counts (ExpertResidency.forget)."""
    for binding in getattr(getattr(session.gpu, "stage", None), "bindings", None) or ():
        residency = getattr(binding.post[-1], "residency", None) if binding.post else None
        if residency is not None:
            residency.forget()


def _rows_bytes(t, experts: int) -> int:
    rows, row_bytes = t.shape
    return rows // experts * row_bytes


def _device_ptr(t) -> int:
    from helmc.runtime.cuda_runtime import tvm_to_cupy
    return tvm_to_cupy(t).data.ptr
