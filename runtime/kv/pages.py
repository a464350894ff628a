"""KV page bookkeeping (thesis 4.2.2): which page of which sequence lives where. Pure Python.

The KV cache is cut into fixed-size pages of `page_tokens` tokens (all layers of a stage in one
page). A page lives in one of two tiers, the GPU pool or the (pinned) host pool, each a fixed
number of slots. This module decides and records placement; it owns no buffers. The GPU cache
(kv_cache_gpu.py) and the CPU cache (kv_cache_cpu.py) turn its decisions into copies.

Life of a page:
    reserve()            new page -> GPU (the newest pages) or HOST (older pages of a long append)
    advance()            commit tokens; pages above the watermark start leaving: GPU -> IN_FLIGHT
    complete_eviction()  the device-to-host copy finished: IN_FLIGHT -> HOST, GPU slot freed
    begin_prefetch()     a HOST page's layer slice is being copied into a staging slot for attention
    end_prefetch()       that staging slot may be reused
    release_before()     a sliding-window layer kind's pages wholly before its window: slots back, page gone
    free_sequence()      every slot of the sequence back to its free list

Invariants (checked by check_invariants() at the end of every mutator that moves or commits pages; the staging
mutators, called per page and layer of every attention over host pages, check I7, the only one they can break:
the whole check is O(pages + slots), and ~400 of them a token held a 32K-context decode step for ~70 ms):
  I1  every live page belongs to exactly one sequence, at position `index - first` of its page list (`first`:
      the sequence's released leading pages, 0 unless release_before was called).
  I2  residency GPU <=> gpu_slot set and host_slot None; HOST <=> host_slot set and gpu_slot None;
      IN_FLIGHT <=> both set (the copy reads the GPU slot and writes the host slot).
  I3  per tier, the free slots and the slots held by pages partition range(capacity), no slot twice.
  I4  per sequence 0 <= length <= reserved <= (first + len(pages)) * page_tokens, and the pages are exactly
      enough: first + len(pages) == ceil(reserved / page_tokens); released pages were wholly committed:
      first * page_tokens <= length.
  I5  (pools with a GPU tier) an IN_FLIGHT page is full and committed; a HOST page is full and
      committed, or lies wholly inside the pending (reserved, not yet committed) range.
  I6  (pools with a GPU tier, between steps: length == reserved) the GPU pages of a sequence are a
      suffix of its page list: evicting oldest-first never leaves an old page behind on the GPU.
  I7  a staging slot holds at most one (page, layer); a staged page is HOST; at most
      `staging_slots` pages are staged at once.
  I8  page stamps increase along every sequence's page list (oldest-first == lowest stamp).
Free slots are handed out lowest first and page ids are never reused, so tests can name them.
"""
from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from helmc.errors import HelmcError


class Residency(enum.Enum):
    GPU = "gpu"
    HOST = "host"
    IN_FLIGHT = "in_flight"      # eviction copy enqueued; still readable in its GPU slot


class PoolExhausted(HelmcError):
    """No free slot in a tier; the caller may complete or start evictions and retry."""


@dataclass(frozen=True)
class PageInfo:
    page_id: int
    seq_id: int
    index: int
    residency: Residency
    gpu_slot: int | None
    host_slot: int | None


@dataclass(frozen=True)
class PageTable:
    """One sequence's live pages in token order: what a buffer owner needs to read or write them. Entry j of the
    tuples is page `first_page + j` (tokens [(first_page + j) * page_tokens, ...)); pages below first_page were
    released (PagePool.release_before)."""
    seq_id: int
    page_tokens: int
    length: int                              # committed tokens
    reserved: int                            # committed + pending tokens
    page_ids: tuple[int, ...]
    residency: tuple[Residency, ...]
    gpu_slots: tuple[int | None, ...]
    host_slots: tuple[int | None, ...]
    first_page: int = 0

    @property
    def n_pages(self) -> int:
        """Live pages (entries of the tuples)."""
        return len(self.page_ids)

    def tokens_in(self, index: int, upto: int | None = None) -> int:
        """Tokens of page `index` (a page index, not a tuple entry) below position `upto` (default: reserved)."""
        upto = self.reserved if upto is None else upto
        return max(0, min(self.page_tokens, upto - index * self.page_tokens))

    def on_device(self, index: int) -> bool:
        """Entry `index` readable in place on the GPU (GPU, or IN_FLIGHT whose GPU slot is still intact)."""
        return self.residency[index] is not Residency.HOST


class _Page:
    __slots__ = ("page_id", "seq_id", "index", "residency", "gpu_slot", "host_slot", "stamp")

    def __init__(self, page_id, seq_id, index, residency, gpu_slot, host_slot, stamp):
        self.page_id, self.seq_id, self.index = page_id, seq_id, index
        self.residency, self.gpu_slot, self.host_slot, self.stamp = residency, gpu_slot, host_slot, stamp


class _Sequence:
    __slots__ = ("pages", "length", "reserved", "first")

    def __init__(self):
        self.pages: list[int] = []     # live page ids; entry j is page index first + j
        self.length = 0
        self.reserved = 0
        self.first = 0                 # leading pages released (release_before)


class _FreeList:
    """Free slots of one tier, lowest first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._heap = list(range(capacity))
        self._set = set(self._heap)

    def take(self) -> int:
        slot = heapq.heappop(self._heap)
        self._set.remove(slot)
        return slot

    def give(self, slot: int) -> None:
        assert 0 <= slot < self.capacity and slot not in self._set, f"slot {slot} freed twice or out of range"
        heapq.heappush(self._heap, slot)
        self._set.add(slot)

    def __len__(self) -> int:
        return len(self._heap)

    def as_set(self) -> set[int]:
        return set(self._set)

    def view(self) -> set[int]:
        """The free slots as a set, not copied: read it, never change it. Invariant (give's assert, the
        constructor): every free slot is in range(capacity)."""
        return self._set


class PagePool:
    def __init__(self, page_tokens: int, gpu_capacity: int, host_capacity: int,
                 gpu_watermark_pages: int | None = None, staging_slots: int = 0):
        if page_tokens < 1 or gpu_capacity < 0 or host_capacity < 0 or staging_slots < 0:
            raise HelmcError(f"page pool: expected page_tokens >= 1 and capacities >= 0, found page_tokens="
                             f"{page_tokens}, gpu={gpu_capacity}, host={host_capacity}, staging={staging_slots}")
        wm = gpu_capacity if gpu_watermark_pages is None else gpu_watermark_pages
        if not (gpu_capacity == 0 or 1 <= wm <= gpu_capacity):
            raise HelmcError(f"page pool: gpu_watermark_pages expected in 1..{gpu_capacity}, found {wm}")
        self.page_tokens = page_tokens
        self.gpu_capacity = gpu_capacity
        self.host_capacity = host_capacity
        self.watermark_pages = wm if gpu_capacity else 0
        self.staging_slots = staging_slots
        self._gpu_free = _FreeList(gpu_capacity)
        self._host_free = _FreeList(host_capacity)
        self._pages: dict[int, _Page] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._staged: dict[int, tuple[int, int]] = {}      # staging slot -> (page_id, layer)
        self._next_page = 0
        self._next_seq = 0
        self._stamp = 0
        self.version = 0          # bumped on every placement change: buffer owners cache derived tables

    # ------------------------------------------------------------------ queries
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    @property
    def gpu_free(self) -> int:
        return len(self._gpu_free)

    @property
    def host_free(self) -> int:
        return len(self._host_free)

    @property
    def gpu_resident(self) -> int:
        """Pages in state GPU (IN_FLIGHT ones are leaving and do not count toward the watermark)."""
        return sum(1 for p in self._pages.values() if p.residency is Residency.GPU)

    def in_flight(self) -> list[int]:
        """IN_FLIGHT page ids, oldest first (the order their copies were enqueued on one stream)."""
        return sorted((p.page_id for p in self._pages.values() if p.residency is Residency.IN_FLIGHT),
                      key=lambda pid: self._pages[pid].stamp)

    def evictable(self) -> list[int]:
        """Full, committed GPU pages, oldest first: what may leave without losing pending writes."""
        out = [p for p in self._pages.values() if p.residency is Residency.GPU and self._full_committed(p)]
        return [p.page_id for p in sorted(out, key=lambda p: p.stamp)]

    def gpu_slots_needed(self, seq_id: int, n_tokens: int) -> int:
        """GPU slots reserve(seq_id, n_tokens) will take."""
        s = self._seq(seq_id)
        k = self.pages_for(s.reserved + n_tokens) - s.first - len(s.pages)
        return min(k, self.watermark_pages)

    def page_info(self, page_id: int) -> PageInfo:
        p = self._pages[page_id]
        return PageInfo(p.page_id, p.seq_id, p.index, p.residency, p.gpu_slot, p.host_slot)

    def page_table(self, seq_id: int) -> PageTable:
        s = self._seq(seq_id)
        ps = [self._pages[i] for i in s.pages]
        return PageTable(seq_id, self.page_tokens, s.length, s.reserved, tuple(s.pages),
                         tuple(p.residency for p in ps), tuple(p.gpu_slot for p in ps),
                         tuple(p.host_slot for p in ps), s.first)

    def staged(self) -> dict[int, tuple[int, int]]:
        return dict(self._staged)

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    # ------------------------------------------------------------------ mutators
    def add_sequence(self) -> int:
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = _Sequence()
        self.check_invariants()
        return sid

    def reserve(self, seq_id: int, n_tokens: int) -> tuple[int, ...]:
        """Make room for n_tokens more tokens; returns the new page ids in order.

        Of k new pages the last min(k, watermark) go to the GPU, the older ones straight to the host
        (a long prompt never needs its whole KV on the GPU). Raises PoolExhausted, changing nothing,
        when a tier lacks free slots.
        """
        if n_tokens < 0:
            raise HelmcError(f"reserve: n_tokens expected >= 0, found {n_tokens}")
        s = self._seq(seq_id)
        k = self.pages_for(s.reserved + n_tokens) - s.first - len(s.pages)
        n_gpu = min(k, self.watermark_pages)
        if n_gpu > self.gpu_free or k - n_gpu > self.host_free:
            raise PoolExhausted(f"KV page pool: {k} new page(s) need {n_gpu} GPU and {k - n_gpu} host slot(s), "
                                f"found {self.gpu_free} and {self.host_free} free")
        new = []
        for j in range(k):
            on_gpu = j >= k - n_gpu
            pid = self._next_page
            self._next_page += 1
            self._stamp += 1
            page = _Page(pid, seq_id, s.first + len(s.pages), Residency.GPU if on_gpu else Residency.HOST,
                         self._gpu_free.take() if on_gpu else None,
                         None if on_gpu else self._host_free.take(), self._stamp)
            self._pages[pid] = page
            s.pages.append(pid)
            new.append(pid)
        s.reserved += n_tokens
        if new:
            self.version += 1
        self.check_invariants()
        return tuple(new)

    def advance(self, seq_id: int, n_tokens: int) -> tuple[int, ...]:
        """Commit n_tokens reserved tokens, then start the evictions the watermark asks for.

        Returns the page ids moved GPU -> IN_FLIGHT, oldest first: the caller must enqueue their
        device-to-host copies and later call complete_eviction(). First go this sequence's GPU pages
        older than one of its HOST pages (a long append put newer pages on the host), then the
        oldest full pages anywhere until at most `watermark_pages` pages are in state GPU.
        """
        s = self._seq(seq_id)
        if not 0 <= n_tokens <= s.reserved - s.length:
            raise HelmcError(f"advance: expected 0..{s.reserved - s.length} tokens (reserved, not committed), "
                             f"found {n_tokens}")
        s.length += n_tokens
        started: list[int] = []
        if self.gpu_capacity and s.length == s.reserved:
            last_host = max((i for i, pid in enumerate(s.pages) if self._pages[pid].residency is not Residency.GPU),
                            default=-1)
            for pid in s.pages[:last_host + 1]:
                if self._pages[pid].residency is Residency.GPU:
                    self._start_eviction(self._pages[pid])
                    started.append(pid)
            over = self.gpu_resident - self.watermark_pages
            for pid in self.evictable()[:max(0, over)]:
                self._start_eviction(self._pages[pid])
                started.append(pid)
        if started:
            self.version += 1
        self.check_invariants()
        return tuple(started)

    def begin_eviction(self, page_id: int) -> int:
        """Start moving one full, committed GPU page to the host (forced, below the watermark too):
        GPU -> IN_FLIGHT. Returns its host slot. Only the oldest GPU page of its sequence may go (I6)."""
        p = self._pages[page_id]
        if p.residency is not Residency.GPU or not self._full_committed(p):
            raise HelmcError(f"begin_eviction: page {page_id} expected full, committed and on the GPU, "
                             f"found {p.residency.value}")
        s = self._seqs[p.seq_id]
        older = [q for q in s.pages[:p.index - s.first] if self._pages[q].residency is Residency.GPU]
        if older:
            raise HelmcError(f"begin_eviction: page {page_id} has older GPU page(s) {older}: evict oldest first")
        host = self._start_eviction(p)
        self.version += 1
        self.check_invariants()
        return host

    def complete_eviction(self, page_id: int) -> None:
        p = self._pages[page_id]
        if p.residency is not Residency.IN_FLIGHT:
            raise HelmcError(f"complete_eviction: page {page_id} expected in_flight, found {p.residency.value}")
        self._gpu_free.give(p.gpu_slot)
        p.gpu_slot = None
        p.residency = Residency.HOST
        self.version += 1
        self.check_invariants()

    def begin_prefetch(self, page_id: int, layer: int, staging_slot: int | None = None) -> int:
        """Record that `layer`'s slice of HOST page `page_id` is being copied into a staging slot
        (the lowest free one unless given); returns the slot."""
        p = self._pages[page_id]
        if p.residency is not Residency.HOST:
            raise HelmcError(f"begin_prefetch: page {page_id} expected on the host, found {p.residency.value}")
        if (page_id, layer) in self._staged.values():
            raise HelmcError(f"begin_prefetch: page {page_id} layer {layer} is already staged")
        if staging_slot is None:
            free = [i for i in range(self.staging_slots) if i not in self._staged]
            if not free:
                raise PoolExhausted(f"begin_prefetch: all {self.staging_slots} staging slots are in use")
            staging_slot = free[0]
        if not 0 <= staging_slot < self.staging_slots or staging_slot in self._staged:
            raise HelmcError(f"begin_prefetch: staging slot expected a free one of 0..{self.staging_slots - 1}, "
                             f"found {staging_slot}")
        self._staged[staging_slot] = (page_id, layer)
        self._check_staging()
        return staging_slot

    def end_prefetch(self, staging_slot: int) -> None:
        if staging_slot not in self._staged:
            raise HelmcError(f"end_prefetch: staging slot {staging_slot} holds nothing")
        del self._staged[staging_slot]
        self._check_staging()

    def release_before(self, seq_id: int, position: int) -> tuple[int, ...]:
        """Release the sequence's pages that lie wholly before `position` (a committed position: the first one a
        sliding-window layer kind still attends to), oldest first: their slots go back to the free lists and the
        page ids are gone. Returns the released ids. The pages must not be in flight or staged."""
        s = self._seq(seq_id)
        if not 0 <= position <= s.length:
            raise HelmcError(f"release_before: position expected in 0..{s.length} (committed), found {position}")
        k = max(0, position // self.page_tokens - s.first)
        gone = s.pages[:k]
        busy = [pid for pid in gone if self._pages[pid].residency is Residency.IN_FLIGHT
                or any(v[0] == pid for v in self._staged.values())]
        if busy:
            raise HelmcError(f"release_before: page(s) {busy} of sequence {seq_id} still have copies in flight")
        for pid in gone:
            p = self._pages.pop(pid)
            if p.gpu_slot is not None:
                self._gpu_free.give(p.gpu_slot)
            if p.host_slot is not None:
                self._host_free.give(p.host_slot)
        del s.pages[:k]
        s.first += k
        if gone:
            self.version += 1
        self.check_invariants()
        return tuple(gone)

    def first_page(self, seq_id: int) -> int:
        """Index of the sequence's oldest live page (its released leading pages)."""
        return self._seq(seq_id).first

    def free_sequence(self, seq_id: int) -> None:
        """Return every slot of the sequence. Its evictions must be completed and prefetches ended."""
        s = self._seq(seq_id)
        busy = [pid for pid in s.pages if self._pages[pid].residency is Residency.IN_FLIGHT]
        staged = [v for v in self._staged.values() if self._pages[v[0]].seq_id == seq_id]
        if busy or staged:
            raise HelmcError(f"free_sequence: sequence {seq_id} still has copies in flight "
                             f"(evicting {busy}, staged {staged})")
        for pid in s.pages:
            p = self._pages.pop(pid)
            if p.gpu_slot is not None:
                self._gpu_free.give(p.gpu_slot)
            if p.host_slot is not None:
                self._host_free.give(p.host_slot)
        del self._seqs[seq_id]
        self.version += 1
        self.check_invariants()

    # ------------------------------------------------------------------ internals
    def _seq(self, seq_id: int) -> _Sequence:
        if seq_id not in self._seqs:
            raise HelmcError(f"page pool: no sequence {seq_id}; live ones are {sorted(self._seqs)}")
        return self._seqs[seq_id]

    def _full_committed(self, p: _Page) -> bool:
        return (p.index + 1) * self.page_tokens <= self._seqs[p.seq_id].length

    def _start_eviction(self, p: _Page) -> int:
        if not self._host_free:
            raise PoolExhausted(f"KV page pool: evicting page {p.page_id} needs a host slot, all "
                                f"{self.host_capacity} are in use")
        assert self._full_committed(p), f"page {p.page_id} is not full yet"
        p.host_slot = self._host_free.take()
        p.residency = Residency.IN_FLIGHT
        return p.host_slot

    def check_invariants(self) -> None:
        _check_invariants(self)

    def _check_staging(self) -> None:
        """I7 alone: what begin_prefetch / end_prefetch change (placement and lengths stay as they were)."""
        assert len(self._staged) <= self.staging_slots, "I7: too many staged pages"
        assert len(set(self._staged.values())) == len(self._staged), "I7: a page layer staged twice"
        for slot, (pid, _layer) in self._staged.items():
            assert 0 <= slot < self.staging_slots, f"I7: staging slot {slot} out of range"
            assert pid in self._pages and self._pages[pid].residency is Residency.HOST, f"I7: staged page {pid} is not HOST"


def _check_invariants(pool: PagePool) -> None:
    """PagePool.check_invariants: I1-I8 of the module docstring (a function of its own: the pool's class stays
    readable)."""
    T = pool.page_tokens
    gpu_held, host_held = [], []
    for sid, s in pool._seqs.items():
        assert 0 <= s.length <= s.reserved, f"I4: seq {sid} length {s.length} reserved {s.reserved}"
        assert s.first + len(s.pages) == pool.pages_for(s.reserved), \
            f"I4: seq {sid} has {s.first} released + {len(s.pages)} pages for {s.reserved} tokens"
        assert s.first * T <= s.length, f"I4: seq {sid} released {s.first} pages, only {s.length} tokens committed"
        stamps = [pool._pages[pid].stamp for pid in s.pages]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), f"I8: seq {sid} stamps {stamps}"
        for i, pid in enumerate(s.pages):
            p = pool._pages.get(pid)
            assert p is not None and p.seq_id == sid and p.index == s.first + i, \
                f"I1: page {pid} of seq {sid} at {s.first + i}"
        if pool.gpu_capacity and s.length == s.reserved:
            res = [pool._pages[pid].residency is Residency.GPU for pid in s.pages]
            first = res.index(True) if True in res else len(res)
            assert all(res[first:]), f"I6: seq {sid} GPU pages are not a suffix: {res}"
    assert sum(len(s.pages) for s in pool._seqs.values()) == len(pool._pages), "I1: orphan pages"
    for p in pool._pages.values():
        s = pool._seqs[p.seq_id]
        has_g, has_h = p.gpu_slot is not None, p.host_slot is not None
        expect = {Residency.GPU: (True, False), Residency.HOST: (False, True), Residency.IN_FLIGHT: (True, True)}
        assert (has_g, has_h) == expect[p.residency], f"I2: page {p.page_id} {p.residency} slots {p.gpu_slot}/{p.host_slot}"
        if has_g:
            gpu_held.append(p.gpu_slot)
        if has_h:
            host_held.append(p.host_slot)
        if pool.gpu_capacity and p.residency is not Residency.GPU:
            full = (p.index + 1) * T <= s.length
            pending = p.index * T >= s.length and (p.index + 1) * T <= s.reserved
            assert full or (p.residency is Residency.HOST and pending), \
                f"I5: page {p.page_id} is {p.residency.value} but neither full nor wholly pending"
    # I3 in O(held), not O(capacity) (this runs in the decode step's host path: 70 us a call over a
    # pool of ~250 slots): free slots lie in range(capacity) (_FreeList.view), so held slots in range, disjoint
    # from the free ones and as many as the capacity leaves are exactly the rest of range(capacity).
    for name, held, free, cap in (("gpu", gpu_held, pool._gpu_free, pool.gpu_capacity),
                                  ("host", host_held, pool._host_free, pool.host_capacity)):
        held_set, free_set = set(held), free.view()
        assert len(held) == len(held_set), f"I3: {name} slot held twice: {sorted(held)}"
        assert len(held_set) + len(free_set) == cap and held_set.isdisjoint(free_set) and \
            all(0 <= slot < cap for slot in held_set), \
            f"I3: {name} slots held {sorted(held)} and free {sorted(free_set)} do not partition 0..{cap - 1}"
    pool._check_staging()
