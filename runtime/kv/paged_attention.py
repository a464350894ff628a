"""Streaming paged attention (thesis 4.2.3, Algorithm 3, eqs. 4.18-4.20), array-module generic.

Attention over a context cut into pages never needs every score at once: keep per query head a
running max m, a running denominator s and an unnormalised output o, fold one page in at a time,
divide once at the end. Three entry points:

  streaming_attention_decode  Algorithm 3 as written: one query row, pages walked in order with
                              prefetch one page ahead; NumPy; the reference for the CUDA kernel.
  attend_blocks               the same update for many query rows (prefill) over key blocks, causal,
                              optional sliding window, query rows tiled so no S x S buffer exists;
                              works with NumPy or CuPy (`xp`).
  full_attention              plain softmax over everything, float64: the reference for both.

GQA: query head h reads KV head h // (h_a / h_kv) (Hugging Face's repeat_kv order).
Sliding window w: query at position p sees keys at positions k with p - w < k <= p.
Attention sinks (gpt-oss): a learned logit per query head in the softmax's denominator with no value: the online
softmax starts from it (m = sink, s = 1, o = 0) instead of from nothing, so every entry point takes it alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

NEG_INF = float("-inf")


# ------------------------------------------------------------------ references
def full_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, q_pos0: int | None = None,
                   window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """q [S, h_a, d]; k, v [n, h_kv, d]; query row i sits at position q_pos0 + i (default: the last S
    key positions); sinks [h_a]: a logit per head in the denominator. Causal. Returns [S, h_a, d] float64."""
    S, h_a, d = q.shape
    n, h_kv, _ = k.shape
    g = h_a // h_kv
    q_pos0 = n - S if q_pos0 is None else q_pos0
    kk = np.repeat(k.astype(np.float64), g, axis=1)                 # [n, h_kv, d] -> [n, h_a, d]
    vv = np.repeat(v.astype(np.float64), g, axis=1)                 # [n, h_kv, d] -> [n, h_a, d]
    e = np.einsum("shd,nhd->hsn", q.astype(np.float64), kk) * scale  # [h_a, S, n]
    qp = q_pos0 + np.arange(S)[:, None]
    kp = np.arange(n)[None, :]
    allowed = kp <= qp                                              # [S, n]
    if window:
        allowed &= kp > qp - window
    e = np.where(allowed[None], e, NEG_INF)
    if sinks is None:
        w = np.exp(e - e.max(-1, keepdims=True))
        return np.einsum("hsn,nhd->shd", w / w.sum(-1, keepdims=True), vv)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (h_a, S, 1))
    w = np.exp(np.concatenate([e, sink], -1) - np.maximum(e.max(-1, keepdims=True), sink))
    return np.einsum("hsn,nhd->shd", w[..., :n] / w.sum(-1, keepdims=True), vv)


# ------------------------------------------------------------------ Algorithm 3
class PageSource(Protocol):
    """Pages in context order. prefetch(i) starts bringing page i to the device, wait(i) returns it
    as (k [h_kv, n_i, d], v [h_kv, n_i, d]) once there, release(i) lets its buffer go."""
    num_pages: int

    def prefetch(self, i: int) -> None: ...
    def wait(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...
    def release(self, i: int) -> None: ...


class ListPageSource:
    """Pages already in memory; counts how many are 'fetched' at once to check Algorithm 3's bound."""

    def __init__(self, pages: Sequence[tuple[np.ndarray, np.ndarray]]):
        self.pages = list(pages)
        self.num_pages = len(self.pages)
        self.live: set[int] = set()
        self.max_live = 0
        self.order: list[tuple[str, int]] = []

    def prefetch(self, i):
        self.live.add(i)
        self.max_live = max(self.max_live, len(self.live))
        self.order.append(("prefetch", i))

    def wait(self, i):
        assert i in self.live, f"page {i} used before its prefetch"
        self.order.append(("wait", i))
        return self.pages[i]

    def release(self, i):
        self.live.discard(i)
        self.order.append(("release", i))


def streaming_attention_decode(q: np.ndarray, pages: PageSource, scale: float,
                               trace: list | None = None) -> np.ndarray:
    """Algorithm 3 for one query row. q [h_a, d]; returns [h_a, d] in q's float type (float64 if q is).

    `trace`, if given, receives (m, s, o) after each page (Table 4.2's columns)."""
    h_a, d = q.shape
    ft = np.float64 if q.dtype == np.float64 else np.float32
    m = np.full(h_a, NEG_INF, ft)                                   # line 1
    s = np.zeros(h_a, ft)
    o = np.zeros((h_a, d), ft)
    if pages.num_pages:
        pages.prefetch(0)                                           # line 2
    for i in range(pages.num_pages):                                # line 3
        k, v = pages.wait(i)                                        # line 4
        if i + 1 < pages.num_pages:
            pages.prefetch(i + 1)                                   # line 6
        h_kv = k.shape[0]
        g = h_a // h_kv
        qg = q.astype(ft).reshape(h_kv, g, d)                       # [h_a, d] -> [h_kv, g, d]
        e = np.matmul(qg, k.astype(ft).transpose(0, 2, 1)) * scale  # line 8: [h_kv, g, n_i]
        e = e.reshape(h_a, -1)                                      # [h_kv, g, n_i] -> [h_a, n_i]
        m_new = np.maximum(m, e.max(-1))                            # line 9, eq. 4.18
        r = np.exp(m - m_new)                                       # line 11 (1 where m did not grow)
        w = np.exp(e - m_new[:, None])                              # line 14
        s = r * s + w.sum(-1)                                       # line 15, eq. 4.19
        pv = np.matmul(w.reshape(h_kv, g, -1), v.astype(ft))        # [h_kv, g, n_i] @ [h_kv, n_i, d]
        o = r[:, None] * o + pv.reshape(h_a, d)                     # line 16, eq. 4.20
        m = m_new                                                   # line 12
        pages.release(i)
        if trace is not None:
            trace.append((m.copy(), s.copy(), o.copy()))
    return o / s[:, None]                                           # line 18


# ------------------------------------------------------------------ blocks, many query rows
@dataclass(frozen=True)
class KeyBlock:
    """`n` consecutive key positions from `pos0`; load() -> (k, v), each [h_kv, n, d]."""
    pos0: int
    n: int
    load: Callable[[], tuple[Any, Any]]


@dataclass
class Partial:
    """Online-softmax state for rows [h_kv, R]: max m, denominator s, unnormalised output o [h_kv, R, d]."""
    m: Any
    s: Any
    o: Any


def partial_attention(xp, qt, q_pos0: int | None, R: int, blocks: Iterable[KeyBlock], scale: float,
                      window: int = 0, compute_dtype=np.float32, sinks=None) -> Partial:
    """Fold `blocks` into fresh online-softmax state for grouped query rows.

    qt [h_kv, g*R, d]: R query rows per head group (row j of a group is query row j % R) at absolute
    positions q_pos0 .. q_pos0+R-1; q_pos0=None means every row sees every key (decode, no window).
    sinks [h_a]: the state starts from them (give them to one of the partials merged, not each).
    """
    cd = np.dtype(compute_dtype).type
    qt = qt.astype(cd, copy=False)
    state = _fresh_state(xp, qt, cd, sinks, R)
    for b in blocks:
        if _sees(b, q_pos0, R, window):
            k, v = b.load()
            _fold(xp, state, qt, q_pos0, R, b, k.astype(cd, copy=False), v.astype(cd, copy=False), scale, window, cd)
    return state


def _fresh_state(xp, qt, cd, sinks=None, R: int = 1) -> Partial:
    """Empty state for grouped rows qt [h_kv, g*R, d]; with sinks [h_a], each row's head's sink already in."""
    h_kv, rows, d = qt.shape
    o = xp.zeros((h_kv, rows, d), dtype=cd)
    if sinks is None:
        return Partial(xp.full((h_kv, rows), NEG_INF, dtype=cd), xp.zeros((h_kv, rows), dtype=cd), o)
    m = xp.repeat(xp.asarray(sinks, dtype=cd).reshape(h_kv, rows // R), R, axis=1)   # [h_a] -> [h_kv, g*R]
    return Partial(m, xp.ones((h_kv, rows), dtype=cd), o)


def _sees(b: KeyBlock, q_pos0: int | None, R: int, window: int) -> bool:
    """Whether any of the R query rows from q_pos0 sees a key of block b (causal, sliding window)."""
    if q_pos0 is None:
        return True
    return not (b.pos0 > q_pos0 + R - 1 or (window and b.pos0 + b.n - 1 <= q_pos0 - window))


def _fold(xp, state: Partial, qt, q_pos0: int | None, R: int, b: KeyBlock, k, v, scale: float, window: int, cd) -> None:
    """One block into the state of rows qt (eqs. 4.18-4.20); k, v [h_kv, n, d] already in the compute dtype."""
    h_kv, rows, d = qt.shape
    g = rows // R
    last_q = None if q_pos0 is None else q_pos0 + R - 1
    e = xp.matmul(qt, k.transpose(0, 2, 1))                         # [h_kv, g*R, n]
    e *= scale
    if q_pos0 is not None and (b.pos0 + b.n - 1 > q_pos0 or (window and b.pos0 <= last_q - window)):
        kp = xp.arange(b.pos0, b.pos0 + b.n)[None, :]
        qp = xp.arange(q_pos0, q_pos0 + R)[:, None]
        allowed = kp <= qp                                          # [R, n]
        if window:
            allowed &= kp > qp - window
        e = xp.where(allowed[None, None], e.reshape(h_kv, g, R, b.n), cd(NEG_INF))  # [h_kv,g*R,n] -> [h_kv,g,R,n]
        e = e.reshape(h_kv, rows, b.n)                              # [h_kv, g, R, n] -> [h_kv, g*R, n]
    m_new = xp.maximum(state.m, e.max(-1))
    m_safe = xp.where(m_new == NEG_INF, cd(0), m_new)               # rows that saw no key yet stay empty
    r = xp.exp(state.m - m_safe)
    w = xp.exp(e - m_safe[..., None])
    state.s = state.s * r + w.sum(-1)
    state.o = state.o * r[..., None] + xp.matmul(w, v)              # [h_kv, g*R, n] @ [h_kv, n, d]
    state.m = m_new


def merge_partials(xp, parts: Sequence[Partial]) -> Any:
    """Combine states computed over disjoint key sets (split-K): returns normalised o [h_kv, rows, d]."""
    m = parts[0].m
    for p in parts[1:]:
        m = xp.maximum(m, p.m)
    m_safe = xp.where(m == NEG_INF, 0, m)
    s = 0
    o = 0
    for p in parts:
        a = xp.exp(p.m - m_safe)
        s = s + a * p.s
        o = o + a[..., None] * p.o
    return o / s[..., None]


def group_queries(xp, q, h_kv: int):
    """[S, h_a, d] -> [h_kv, g*S, d], query head h to group h // g, rows ordered (g, S)."""
    S, h_a, d = q.shape
    g = h_a // h_kv
    return q.reshape(S, h_kv, g, d).transpose(1, 2, 0, 3).reshape(h_kv, g * S, d)   # [S,h_kv,g,d] -> [h_kv,g*S,d]


def ungroup_output(o, S: int):
    """[h_kv, g*S, d] -> [S, h_a, d], inverse of group_queries."""
    h_kv, rows, d = o.shape
    g = rows // S
    return o.reshape(h_kv, g, S, d).transpose(2, 0, 1, 3).reshape(S, h_kv * g, d)     # [h_kv,g,S,d] -> [S,h_a,d]


def attend_blocks(xp, q, q_pos0: int, blocks: Sequence[KeyBlock], num_kv_heads: int, scale: float,
                  window: int = 0, compute_dtype=np.float32, score_budget_bytes: int = 64 << 20,
                  state_budget_bytes: int = 64 << 20, sinks=None):
    """Causal attention of S query rows at positions q_pos0.. over key blocks in position order.

    q [S, h_a, d] (sinks [h_a]: a logit per head in the denominator); returns [S, h_a, d] in q's dtype. Query rows are tiled so that one score tile
    (h_a x rows x largest block) stays under score_budget_bytes; there is never an S x S buffer.
    Blocks are the outer loop over a group of tiles whose online-softmax states fit state_budget_bytes:
    each block is loaded (a host page staged, 16-bit keys widened) once per group, not once per tile.
    """
    S, h_a, d = q.shape
    if not blocks:
        raise ValueError("attend_blocks: no keys to attend to")
    cd = np.dtype(compute_dtype).type
    biggest = max(b.n for b in blocks)
    itemsize = np.dtype(compute_dtype).itemsize
    tile = max(1, min(S, score_budget_bytes // max(1, h_a * biggest * itemsize * 2)))
    group = max(tile, min(S, state_budget_bytes // max(1, h_a * (d + 2) * itemsize)) // tile * tile)
    out = xp.empty((S, h_a, d), dtype=q.dtype)
    for g0 in range(0, S, group):
        g1 = min(S, g0 + group)
        tiles = [(r0, min(g1, r0 + tile)) for r0 in range(g0, g1, tile)]
        qts = [group_queries(xp, q[r0:r1], num_kv_heads).astype(cd, copy=False) for r0, r1 in tiles]
        states = [_fresh_state(xp, qt, cd, sinks, r1 - r0) for qt, (r0, r1) in zip(qts, tiles)]
        for b in blocks:
            seen = [i for i, (r0, r1) in enumerate(tiles) if _sees(b, q_pos0 + r0, r1 - r0, window)]
            if not seen:
                continue
            k, v = b.load()
            k, v = k.astype(cd, copy=False), v.astype(cd, copy=False)
            for i in seen:
                r0, r1 = tiles[i]
                _fold(xp, states[i], qts[i], q_pos0 + r0, r1 - r0, b, k, v, scale, window, cd)
        for (r0, r1), st in zip(tiles, states):
            o = st.o / st.s[..., None]
            out[r0:r1] = ungroup_output(o, r1 - r0).astype(q.dtype, copy=False)
    return out


def contiguous_blocks(k, v, pos0: int, block_tokens: int) -> list[KeyBlock]:
    """KeyBlocks over contiguous k, v [h_kv, n, d] starting at position pos0."""
    n = k.shape[1]
    return [KeyBlock(pos0 + a, min(block_tokens, n - a),
                     (lambda a=a: (k[:, a:a + block_tokens], v[:, a:a + block_tokens])))
            for a in range(0, n, block_tokens)]
