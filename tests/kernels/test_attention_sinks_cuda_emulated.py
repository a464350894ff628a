"""Attention sinks in the CUDA attention kernels' own source, run on CPU threads by the harnesses of
test_paged_attention_cuda_emulated.py (decode, prefill_causal) and test_flash_prefill_emulated.py (flash_prefill):
each kernel given `sinks` ([h_a] fp32 logits in the softmax's denominator, no value) against
runtime/kv/paged_attention.full_attention(..., sinks=) in float64 over the same fp16 inputs (recomputed here).

The conventions checked: the split family adds the sink once in the merge (partials over two launches, then
paged_decode_merge; paged_decode_fused gives the merge's bits; the batched launch each sequence's bits alone); the
short kernels start slot 0 from it (paged_decode_short, _append and _append_batch give one set of bits); prefill_causal
and flash_prefill start each row from it, and flash's carried state counts it once over three launches. Each test
also checks that the sinks move the output, so that dropping them fails. Skipped without g++.
"""
import ctypes
import shutil

import numpy as np
import pytest

from helmc.runtime.kv.paged_attention import full_attention
from test_flash_prefill_emulated import build as build_flash
from test_paged_attention_cuda_emulated import build

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
fp, ip, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SCALE = 0.3


def sink_logits(h_a: int, seed: int) -> np.ndarray:
    """Logits near the larger scores here (q.k * 0.3 over 64-128 dims: a few units): a visible share of each softmax."""
    return (np.random.default_rng(seed).standard_normal(h_a) * 1.5 + 5.0).astype(np.float32)


def window_reference(q, pool, slots, T: int, t_begin: int, n: int, sinks):
    """full_attention in float64 of the one query row q [h_a, d] over tokens t_begin..n-1 of the pages slots[i] of pool
    [pages, 2, h_kv, T, d], with sinks (None: without)."""
    rows = np.stack([pool[slots[t // T], :, :, t % T] for t in range(t_begin, n)])   # [n', 2, h_kv, d]
    return full_attention(q[None], rows[:, 0], rows[:, 1], SCALE, sinks=sinks)[0]


def rel(out, ref) -> float:
    return float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())


def paged(rng, n, T, h_kv, d):
    """A shuffled pool holding n tokens and the page table's addresses: (pool, slots, ptrs)."""
    n_pages = -(-n // T)
    pool = rng.standard_normal((n_pages + 2, 2, h_kv, T, d)).astype(np.float16)
    slots = rng.permutation(n_pages + 2)[:n_pages]
    return pool, slots, np.array([pool.ctypes.data + int(s) * pool[0].nbytes for s in slots], np.int64)


@pytest.mark.parametrize("h_kv,group,d,T,n,span,t_begin,cut", [
    (2, 4, 128, 16, 45, 16, 0, 1),     # three splits over two launches of the partials
    (1, 2, 64, 8, 300, 8, 20, 9),      # 38 splits (the fused merge stages them 32 at a time), a window start
])
def test_split_decode_adds_the_sink_once_in_the_merge(tmp_path, h_kv, group, d, T, n, span, t_begin, cut):
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(n + d)
    pool, slots, ptrs = paged(rng, n, T, h_kv, d)
    h_a = h_kv * group
    n_splits, first = -(-len(slots) * T // span), t_begin // span
    q = rng.standard_normal((h_a, d)).astype(np.float16)
    sinks = sink_logits(h_a, d)
    step = np.array([n, t_begin], np.int32)
    pm, ps, po = (np.full(k, np.nan, np.float32) for k in (n_splits * h_a, n_splits * h_a, n_splits * h_a * d))
    outs = {}
    lib.set_sinks(fp(sinks.ctypes.data))
    try:
        for s0, s1 in ((first, cut), (cut, n_splits)):       # the partials never see the sink: any launches
            lib.run_partial(fp(q.ctypes.data), fp(ptrs.ctypes.data), ip(T), fp(step.ctypes.data), ip(span), ip(s0),
                            ip(s1 - s0), ip(h_kv), f(SCALE), fp(pm.ctypes.data), fp(ps.ctypes.data), fp(po.ctypes.data))
        for with_sinks in (True, False):
            lib.set_sinks(fp(sinks.ctypes.data) if with_sinks else None)
            outs[with_sinks] = np.full((h_a, d), np.nan, np.float16)
            lib.run_merge(fp(pm.ctypes.data), fp(ps.ctypes.data), fp(po.ctypes.data), ip(first), ip(n_splits), ip(h_a),
                          fp(outs[with_sinks].ctypes.data))
        lib.set_sinks(fp(sinks.ctypes.data))
        counters, fused = np.zeros(h_kv, np.int32), np.full((h_a, d), np.nan, np.float16)
        lib.run_fused(fp(q.ctypes.data), fp(ptrs.ctypes.data), ip(T), fp(step.ctypes.data), ip(span), ip(first),
                      ip(n_splits - first), ip(h_kv), f(SCALE), fp(pm.ctypes.data), fp(ps.ctypes.data),
                      fp(po.ctypes.data), fp(counters.ctypes.data), fp(fused.ctypes.data))
    finally:
        lib.set_sinks(None)
    ref, plain = (window_reference(q, pool, slots, T, t_begin, n, s) for s in (sinks, None))
    err, err_plain = rel(outs[True], ref), rel(outs[False], plain)
    print(f"\nsplit decode with sinks, d={d} group={group} n={n}: error {err:.2e} (without: {err_plain:.2e}); the "
          f"sinks move the output by {rel(ref, plain):.2e}")
    assert err < 1e-3 and err_plain < 1e-3 and rel(ref, plain) > 0.02
    assert np.array_equal(fused.view(np.uint16), outs[True].view(np.uint16)) and not counters.any()


@pytest.mark.parametrize("h_kv,group,d,T", [(2, 4, 128, 16), (1, 2, 64, 8)])
def test_batched_fused_append_shares_one_layers_sinks(tmp_path, h_kv, group, d, T):
    """paged_decode_fused_append_batch with one sinks pointer for every sequence: each sequence's output is the bits
    of paged_decode_fused_append with those sinks for it alone, and within fp16 rounding of the reference."""
    from helmc.schedules.gpu.paged_attention import SEQ_FIELDS
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(d + T + 1)
    seqs = [(45, T, 0), (T // 2, T // 4, 0), (3 * T + 1, T, T + 2)]     # (tokens, tokens a split, window start)
    B, h_a = len(seqs), h_kv * group
    q = rng.standard_normal((B, h_a, d)).astype(np.float16)
    k, v = (rng.standard_normal((B, h_kv, d)).astype(np.float16) for _ in range(2))
    sinks = sink_logits(h_a, T)
    table, keep, alone, refs = np.zeros((B, len(SEQ_FIELDS)), np.int64), [], [], []
    lib.set_sinks(fp(sinks.ctypes.data))
    try:
        for b, (n, span, t_begin) in enumerate(seqs):
            pool, slots, _ = paged(rng, n, T, h_kv, d)
            n_splits, first = -(-len(slots) * T // span), t_begin // span
            step = np.array([n, t_begin], np.int32)
            for batch in (False, True):
                pages = pool.copy()
                ptrs = np.array([pages.ctypes.data + int(s) * pages[0].nbytes for s in slots], np.int64)
                parts = [np.full(m, np.nan, np.float32) for m in (n_splits * h_a, n_splits * h_a, n_splits * h_a * d)]
                counters = np.zeros(h_kv, np.int32)
                keep.append((pages, ptrs, parts, counters, step))
                if batch:
                    table[b] = [ptrs.ctypes.data, step.ctypes.data, *(a.ctypes.data for a in parts),
                                counters.ctypes.data, span, first, n_splits - first]
                    continue
                out = np.full((h_a, d), np.nan, np.float16)
                lib.run_fused_append(fp(q[b].ctypes.data), fp(k[b].ctypes.data), fp(v[b].ctypes.data),
                                     fp(ptrs.ctypes.data), ip(T), fp(step.ctypes.data), ip(span), ip(first),
                                     ip(n_splits - first), ip(h_kv), f(SCALE), *(fp(a.ctypes.data) for a in parts),
                                     fp(counters.ctypes.data), fp(out.ctypes.data))
                alone.append(out)
                refs.append(window_reference(q[b], pages, slots, T, t_begin, n, sinks))
        out = np.zeros((B, h_a, d), np.float16)
        lib.set_reverse_blocks(1)
        lib.run_fused_append_batch(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), fp(table.ctypes.data),
                                   ip(T), ip(h_kv), f(SCALE), fp(out.ctypes.data), ip(int(table[:, -1].max())), ip(B))
    finally:
        lib.set_reverse_blocks(0)
        lib.set_sinks(None)
    for b in range(B):
        assert np.array_equal(out[b].view(np.uint16), alone[b].view(np.uint16)), f"sequence {b}: output differs"
        assert rel(out[b], refs[b]) < 1e-3, (b, rel(out[b], refs[b]))


@pytest.mark.parametrize("h_kv,group,d,T,n,t_begin", [
    (2, 4, 128, 16, 45, 0),            # three pages, the last partly filled
    (1, 4, 256, 16, 1, 0),             # the first token: one row, slot 0 holds the sink and that row
    (2, 2, 256, 16, 30, 14),           # a sliding window's start
])
def test_short_kernels_start_slot_zero_from_the_sink(tmp_path, h_kv, group, d, T, n, t_begin):
    """paged_decode_short (after paged_append_decode), _append and _append_batch with sinks: within fp16 rounding of
    the reference, one set of bits."""
    from helmc.schedules.gpu.paged_attention import SEQ_FIELDS
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(n + d + T + 1)
    pool, slots, _ = paged(rng, n, T, h_kv, d)
    h_a = h_kv * group
    q = rng.standard_normal((1, h_a, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, h_kv, d)).astype(np.float16) for _ in range(2))
    sinks = sink_logits(h_a, n)
    step = np.array([n, t_begin], np.int32)
    pages = [pool.copy() for _ in range(3)]
    ptrs = [np.array([p.ctypes.data + int(s) * p[0].nbytes for s in slots], np.int64) for p in pages]
    outs = [np.full((1, h_a, d), np.nan, np.float16) for _ in range(3)]
    table = np.zeros((1, len(SEQ_FIELDS)), np.int64)
    table[0, :2] = ptrs[2].ctypes.data, step.ctypes.data                 # n_splits 0: the short kernel's
    lib.set_sinks(fp(sinks.ctypes.data))
    try:
        lib.run_append(fp(k.ctypes.data), fp(v.ctypes.data), fp(ptrs[0].ctypes.data), ip(T), ip(h_kv),
                       fp(step.ctypes.data))
        lib.run_short(fp(q.ctypes.data), fp(ptrs[0].ctypes.data), ip(T), fp(step.ctypes.data), ip(h_kv), f(SCALE),
                      fp(outs[0].ctypes.data))
        lib.run_short_append(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), fp(ptrs[1].ctypes.data), ip(T),
                             fp(step.ctypes.data), ip(h_kv), f(SCALE), fp(outs[1].ctypes.data))
        lib.run_short_append_batch(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), fp(table.ctypes.data),
                                   ip(T), ip(h_kv), f(SCALE), fp(outs[2].ctypes.data), ip(1))
    finally:
        lib.set_sinks(None)
    ref, plain = (window_reference(q[0], pages[0], slots, T, t_begin, n, s) for s in (sinks, None))
    print(f"\nshort decode with sinks, d={d} n={n} t_begin={t_begin}: error {rel(outs[0][0], ref):.2e}; the sinks "
          f"move the output by {rel(ref, plain):.2e}")
    assert rel(outs[0][0], ref) < 1e-3 and rel(ref, plain) > 0.02
    assert all(np.array_equal(outs[0].view(np.uint16), o.view(np.uint16)) for o in outs[1:])
    assert all(np.array_equal(pages[0], p) for p in pages[1:])


@pytest.mark.parametrize("h_kv,group,d,S,window", [(2, 4, 128, 7, 0), (1, 2, 64, 13, 5)])
def test_prefill_causal_starts_each_row_from_the_sink(tmp_path, h_kv, group, d, S, window):
    lib = build(tmp_path, d, group)
    rng = np.random.default_rng(S + d + 1)
    h_a = h_kv * group
    q = rng.standard_normal((S, h_a, d)).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, S, d)).astype(np.float16)
    sinks = sink_logits(h_a, S)
    out = np.full((S, h_a, d), np.nan, np.float16)
    lib.set_sinks(fp(sinks.ctypes.data))
    try:
        lib.run_prefill(fp(q.ctypes.data), fp(kv.ctypes.data), ip(S), ip(h_kv), ip(window), f(SCALE),
                        fp(out.ctypes.data))
    finally:
        lib.set_sinks(None)
    k, v = kv[0].transpose(1, 0, 2), kv[1].transpose(1, 0, 2)           # [h_kv, S, d] -> [S, h_kv, d]
    ref = full_attention(q, k, v, SCALE, 0, window, sinks)
    assert rel(out, ref) < 1e-3 and rel(ref, full_attention(q, k, v, SCALE, 0, window)) > 0.02


@pytest.mark.parametrize("window", [0, 90])
def test_flash_prefill_counts_the_sink_once_across_launches(tmp_path, window):
    """flash_prefill with sinks: one launch over every key, and three launches with the state carried (the first
    starts from the sinks, the others read them in the state), both within the kernel's tolerance of the reference."""
    h_kv, group, d, n_q, q_pos0 = 2, 2, 32, 64, 256
    lib = build_flash(tmp_path, d, group)
    rng = np.random.default_rng(window + 9)
    h_a, n_k = h_kv * group, q_pos0 + n_q
    q = (rng.standard_normal((n_q, h_a, d)) * 2).astype(np.float16)
    kv = rng.standard_normal((2, h_kv, n_k, d)).astype(np.float16)
    sinks = sink_logits(h_a, window)                     # above most scores: counted twice would show
    one, three = (np.full((n_q, h_a, d), np.nan, np.float16) for _ in range(2))
    state = np.full((n_q, h_a, d + 2), np.nan, np.float32)
    lib.set_sinks(fp(sinks.ctypes.data))
    try:
        lib.run_flash(fp(q.ctypes.data), fp(kv[0].ctypes.data), fp(kv[1].ctypes.data), ctypes.c_longlong(n_k * d),
                      ip(n_q), ip(n_k), ip(q_pos0), ip(h_kv), ip(window), f(1 / np.sqrt(d)), fp(one.ctypes.data),
                      fp(None), ip(0), ip(0))
        for i, (a, b) in enumerate(((0, 128), (128, 256), (256, 320))):
            k, v = np.ascontiguousarray(kv[0, :, a:b]), np.ascontiguousarray(kv[1, :, a:b])   # [h_kv, b - a, d]
            lib.run_flash_state(fp(q.ctypes.data), fp(k.ctypes.data), fp(v.ctypes.data), ctypes.c_longlong((b - a) * d),
                                ip(n_q), ip(b - a), ip(q_pos0), ip(h_kv), ip(window), f(1 / np.sqrt(d)),
                                fp(three.ctypes.data), ip(a), fp(state.ctypes.data), ip(i > 0), ip(i < 2))
    finally:
        lib.set_sinks(None)
    keys = [x.transpose(1, 0, 2) for x in kv]                            # [h_kv, n_k, d] -> [n_k, h_kv, d]
    ref = full_attention(q, *keys, 1 / np.sqrt(d), q_pos0, window, sinks)
    plain = full_attention(q, *keys, 1 / np.sqrt(d), q_pos0, window)
    print(f"\nflash with sinks, window={window}: one launch {rel(one, ref):.2e}, three {rel(three, ref):.2e}; the "
          f"sinks move the output by {rel(ref, plain):.2e}")
    assert not np.isnan(one).any() and not np.isnan(three).any()
    assert rel(one, ref) < 4e-3 and rel(three, ref) < 4e-3 and rel(ref, plain) > 0.02
