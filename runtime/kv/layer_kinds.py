"""The CPU cache's layers grouped by attention window: one page table and one arena per kind.

Every layer of a kind attends over the same positions, so a kind's layers share one page table (a sequence
of its own in a PagePool of the kind's own) and one arena [L_kind, 2, h_kv, slots * T, d]. A kind with a
sliding window releases its pages as they leave the window (PagePool.release_before, after each committed
step): its free slots are handed out again lowest first, so the arena rows it ever writes (and the memory the
OS commits for them, the arena being np.empty) stay within `live_pages_bound` pages, however long the
sequence. Global layers (window 0) keep every page.

Invariant (checked by check() after every step's commit): a sliding kind's oldest live page is the one holding
position length - window + 1, the first one the next query sees (or page 0 while the window reaches back
that far); a global kind's is page 0.
"""
from __future__ import annotations

from helmc.runtime.kv.pages import PagePool, PageTable


class KindPages:
    def __init__(self, window: int, layers: tuple[int, ...], page_tokens: int, n_slots: int, arena):
        self.window, self.layers = window, layers
        self.page_tokens = page_tokens
        self.pool = PagePool(page_tokens, gpu_capacity=0, host_capacity=n_slots)
        self.arena = arena                        # [len(layers), 2, h_kv, n_slots * T, d]
        self.seq = self.pool.add_sequence()
        self._table_key = None
        self._table: PageTable | None = None
        self._runs_key = None
        self._runs: list[tuple[int, int, int]] = []

    @property
    def length(self) -> int:
        return self.pool.length(self.seq)

    def live_pages_bound(self, rows: int = 1) -> int:
        """Pages a step of `rows` rows holds at most: the window's and the step's positions, one page more where
        they straddle page boundaries (all of them for a global kind: None)."""
        if not self.window:
            return self.pool.host_capacity
        positions = self.window - 1 + rows               # n positions lie on at most ceil((n - 1) / T) + 1 pages
        return min(self.pool.host_capacity, -(-(positions - 1) // self.page_tokens) + 1)

    def window_start(self, n: int) -> int:
        """The first of positions 0..n-1 the newest query (position n-1) sees."""
        return max(0, n - self.window) if self.window else 0

    def reset(self) -> None:
        self.pool.free_sequence(self.seq)
        self.seq = self.pool.add_sequence()
        self._runs_key = None

    def reserve(self, rows: int) -> None:
        self.pool.reserve(self.seq, rows)

    def advance(self, rows: int) -> tuple[int, ...]:
        """Commit the step's rows, then release the pages wholly before the next query's window. Returns the
        released page ids."""
        self.pool.advance(self.seq, rows)
        released = self.pool.release_before(self.seq, self.window_start(self.length + 1)) if self.window else ()
        self.check()
        return released

    def check(self) -> None:
        first = self.pool.first_page(self.seq)
        expect = self.window_start(self.length + 1) // self.page_tokens
        assert first == expect, f"kind window {self.window}: oldest live page {first}, expected {expect}"

    def table(self, pending: int) -> PageTable:
        """The kind's page table, rebuilt only when placement or length changed."""
        key = (self.pool.version, self.length, pending)
        if key != self._table_key:
            self._table, self._table_key = self.pool.page_table(self.seq), key
        return self._table

    def slot_runs(self, n: int, pending: int) -> list[tuple[int, int, int]]:
        """(first position, arena row of that position, tokens) for each run of consecutive slots over the live
        pages' positions below n."""
        key = (self.pool.version, n)
        if key != self._runs_key:
            T = self.page_tokens
            table = self.table(pending)
            runs: list[list[int]] = []
            for j, slot in enumerate(table.host_slots):
                i = table.first_page + j
                tok = table.tokens_in(i, n)
                if runs and runs[-1][1] + runs[-1][2] == slot * T and runs[-1][2] % T == 0:
                    runs[-1][2] += tok
                elif tok:
                    runs.append([i * T, slot * T, tok])
            self._runs = [tuple(r) for r in runs]
            self._runs_key = key
        return self._runs

    def row_of(self, position: int, pending: int) -> int:
        """Arena row of a live position."""
        T = self.page_tokens
        table = self.table(pending)
        return table.host_slots[position // T - table.first_page] * T + position % T
