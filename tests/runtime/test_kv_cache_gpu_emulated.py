"""KVCacheGPU's page movement and addressing, on the CPU through tests/kv_device_emulator.py.

Everything but CuPy and the CUDA kernels runs for real: the page pool and its eviction decisions,
pinned extents, 2-D copies with their pitches, staging slots, pointer tables and split plans.
Unwritten device memory is NaN and the emulated kernel may read only device buffers, so a wrong
address shows up as NaN or an assertion. Decode with offload must equal decode without it
bit for bit (same splits, same order); everything must match full softmax over the fp16 K/V
(float64 reference recomputed here, nothing to regenerate). Each test prints its max error.
"""
import numpy as np
import pytest

from helmc.runtime.kv.cache_gpu import KVCacheGPU
from helmc.runtime.kv.pages import Residency
from helmc.runtime.kv.paged_attention import full_attention
from kv_device_emulator import EmulatedOps

H_KV, GROUP, D, T = 2, 4, 32, 8


def make(offload=True, delay=False, **kw):
    return KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256,
                      offload=offload, staging_pages=4, ops=EmulatedOps(num_sms=2, delay_events=delay), **kw)


DECODE_TOL = 2e-3    # decode reads fp16 queries and writes fp16 outputs (2^-11 relative rounding), as on the GPU


def drive(caches, steps, seed, window=0, q_dtype=np.float32):
    """Feed identical rows to every cache; return max relative error vs full softmax (prefill steps, and
    decode steps against the reference over the fp16-rounded query divided by DECODE_TOL / 1e-5, so that one
    bound of 1e-5 checks both) and whether all decode outputs were bitwise equal across caches."""
    rng = np.random.default_rng(seed)
    L = caches[0].L
    hist = [[np.zeros((0, H_KV, D), np.float16)] * 2 for _ in range(L)]
    worst, identical = 0.0, True
    for S in steps:
        for layer in range(L):
            k, v = rng.standard_normal((2, S, H_KV, D)).astype(np.float32)
            q = rng.standard_normal((S, H_KV * GROUP, D)).astype(q_dtype)
            outs = []
            for c in caches:
                c.append(layer, k, v)
                outs.append(c.attend(layer, q, 0.2))
                assert c.pool.staged() == {}, "every staging slot is released after attention"
            hist[layer] = [np.concatenate([hist[layer][0], k.astype(np.float16)]),
                           np.concatenate([hist[layer][1], v.astype(np.float16)])]
            q_ref = q.astype(np.float16) if S == 1 else q
            ref = full_attention(q_ref, hist[layer][0], hist[layer][1], 0.2, window=window)
            scale = 1e-5 / DECODE_TOL if S == 1 and q_dtype != np.float16 else 1.0
            for o in outs:
                assert o.shape == (S, H_KV * GROUP, D) and o.dtype == q_dtype
                worst = max(worst, scale * float(np.abs(o.astype(np.float64) - ref).max() / np.abs(ref).max()))
            if S == 1:
                identical &= all(np.array_equal(outs[0], o) for o in outs[1:])
        for c in caches:
            c.advance(S)
            assert c.pool.gpu_resident <= c.resident_limit
    return worst, identical


def test_offload_equals_no_offload_bit_for_bit():
    off, full = make(gpu_pages=3, watermark=0.5), make(offload=False)
    assert (off.gpu_pages, off.resident_limit) == (3, 1)
    steps = [37] + [1] * 30 + [13] + [1] * 10                  # second prefill attends over host pages
    worst, identical = drive([off, full], steps, seed=1)
    t = off.pool.page_table(off._seq)
    n_host = sum(r is not Residency.GPU for r in t.residency)
    print(f"\nemulated GPU KV: {t.n_pages} pages, {n_host} off the GPU, {off.ops.h2d_bytes / 2**20:.2f} MiB "
          f"prefetched; max relative error vs full = {worst:.2e}; decode bitwise equal: {identical}")
    assert worst < 1e-5
    assert identical
    assert n_host >= t.n_pages - 2 and off.ops.h2d_bytes > 0 and full.ops.h2d_bytes == 0
    assert off.ops.copies[2] > 0                               # device-to-host evictions happened


def test_slow_evictions_and_sliding_window():
    slow = make(delay=True, gpu_pages=2, watermark=0.9)       # every eviction must be waited for
    full = make(offload=False)
    assert (slow.gpu_pages, slow.resident_limit) == (2, 1)
    worst, identical = drive([slow, full], [5] + [1] * 20 + [9, 1, 1], seed=2)
    assert worst < 1e-5 and identical
    win = make(gpu_pages=3, watermark=0.5, sliding_window=11)
    worst_w, _ = drive([win], [19] + [1] * 12 + [3, 1], seed=3, window=11)
    print(f"\nslow evictions: max relative error {worst:.2e}; sliding window 11: {worst_w:.2e}")
    assert worst_w < 1e-5


def test_evicted_and_direct_host_pages_round_trip():
    from gpu_kv_checks import check_round_trip
    c = KVCacheGPU(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16, max_tokens=256, gpu_pages=3,
                   watermark=0.4, staging_pages=4, ops=EmulatedOps(delay_events=True))
    check_round_trip(c, lambda a: a, lambda: c._complete_evictions(block=True, want=c.gpu_pages))
    assert c.ops.copies[2] >= 3                                # evictions plus the direct host writes


def test_fp16_queries_reset_and_capacity_errors():
    off = make(gpu_pages=3, watermark=0.5)
    worst, _ = drive([off], [20] + [1] * 5, seed=4, q_dtype=np.float16)
    assert worst < 2e-3                                         # output rounded to fp16
    off.reset()
    assert off.length == 0 and off.pool.gpu_free == 3
    worst, _ = drive([off], [3, 1], seed=5)
    assert worst < 1e-5
    with pytest.raises(Exception, match="room for 256"):
        z = np.zeros((300, H_KV, D), np.float32)
        off.append(0, z, z)
    with pytest.raises(Exception, match="no-kv-offload"):
        make(offload=False, vram_bytes=1000)


def test_empty_pool_is_lent_to_the_streamed_prefill_and_only_while_empty():
    """The streamed prefill borrows the page pool's VRAM before any GPU block writes KV: a loan is
    the pool's own bytes, refused when too big or once a page exists, and pages written after the
    loan decode exactly as in a cache that never lent (the borrower's scribbles are overwritten)."""
    kv, ref = make(gpu_pages=3, watermark=0.5), make(gpu_pages=3, watermark=0.5)
    pool_bytes = kv.gpu_store.nbytes
    assert pool_bytes == 3 * 2 * 2 * H_KV * T * D * 2                  # 3 slots x 2 layers x K|V, fp16
    assert kv.lend_empty_pool(pool_bytes + 1) is None
    loan = kv.lend_empty_pool(pool_bytes)
    assert loan is not None and loan.size == pool_bytes and loan.dtype == np.uint8
    assert np.shares_memory(loan, kv.gpu_store)
    loan[:] = 0x7E                                                      # the borrower writes garbage fp16
    worst, identical = drive([kv, ref], [5] + [1] * 12, seed=4)
    print(f"\nafter a loan: max rel err {worst:.2e}, decode identical to a cache that never lent: {identical}")
    assert worst < 2e-3 and identical
    assert kv.lend_empty_pool(16) is None                               # the pool holds pages now
    kv.reset()
    assert kv.lend_empty_pool(16) is not None                           # a new request: empty again


def test_short_context_splits_cut_pages_and_stay_bitwise_equal():
    """With fewer pages than ~4 blocks per SM need, a split is part of a page (here: 128-token pages, 3 pages,
    32 splits wanted, a quarter page each): the split plan still depends on the page count alone, host pages are staged whole
    for the splits that share them, and decode equals the cache that never offloads, bit for bit."""
    def cache(**kw):
        return KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=128, max_tokens=1024,
                          staging_pages=4, ops=EmulatedOps(num_sms=16), **kw)
    off, full = cache(gpu_pages=3, watermark=0.5), cache(offload=False)
    worst, identical = drive([off, full], [300] + [1] * 12, seed=7)
    span, n_splits = off._split_plan(off._table())[:2]
    t = off.pool.page_table(off._seq)
    on_host = sum(not t.on_device(i) for i in range(t.n_pages))
    print(f"\ncut pages: {t.n_pages} pages ({on_host} on the host), {n_splits} splits of {span} tokens; "
          f"max relative error {worst:.2e}; bitwise equal: {identical}")
    assert (span, n_splits) == (32, 12) and on_host >= 1                 # 4 splits per page
    assert worst < 1e-5 and identical


@pytest.mark.parametrize("flash", [True, False])
def test_fresh_fp16_prompt_takes_one_attention_kernel_per_layer(flash):
    """A fresh fp16 prompt's attention is one kernel per layer: flash_prefill where the cubin has it (sm_80+,
    any length), else prefill_causal; later chunks (keys in pages) keep the tiles. Both match full softmax."""
    c = KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256, staging_pages=4,
                   ops=EmulatedOps(num_sms=2, flash=flash), gpu_pages=3, watermark=0.5)
    worst, _ = drive([c], [20, 7], seed=6, q_dtype=np.float16)
    assert worst < 2e-3
    assert c.ops.flash_launches == (2 if flash else 0)          # the fresh step's two layers only (pages of 8: not 64)


@pytest.mark.parametrize("gpu_pages,staging", [(16, 4), (2, 4), (2, 2)])
def test_later_chunks_take_flash_over_device_and_staged_host_pages(gpu_pages, staging):
    """A later prefill chunk (pages of 64 tokens, the chunk at a multiple of 64) goes to flash_prefill: device pages
    read in place through a page table, host pages staged `staging` at a time with the softmax state carried
    between launches; one launch per layer and step while every page is on the device, more once pages sit in
    host RAM (a launch per staged group). Outputs match full softmax either way."""
    c = KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=64, max_tokens=512,
                   staging_pages=staging, ops=EmulatedOps(num_sms=2), gpu_pages=gpu_pages, watermark=0.5)
    steps = [128, 64, 64, 64, 64, 64]
    worst, _ = drive([c], steps, seed=7, q_dtype=np.float16)
    print(f"\n{gpu_pages} GPU pages, {staging} staging: {c.ops.flash_launches} flash launches, max error {worst:.2e}")
    assert worst < 2e-3
    if gpu_pages == 16:
        assert c.ops.flash_launches == 2 * len(steps)
    else:
        assert c.ops.flash_launches > 2 * len(steps) and c.pool.staged() == {}


def test_resident_decode_takes_one_fused_launch_and_host_pages_the_two():
    """Decode attention over pages all on the device is one launch (paged_decode_fused_append: the step's row
    written, the partials, then the merge by each KV head's last block); a cubin without the append in it launches
    the append and paged_decode_fused; a step with a split over a host page, or a cubin without either, launches
    append, partials and merge. The outputs agree bit for bit whichever ran."""
    def cache(fused, fused_append=None, **kw):
        return KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256,
                          staging_pages=4, ops=EmulatedOps(num_sms=2, fused=fused, fused_append=fused_append), **kw)
    fused, apart, off = cache(True, offload=False), cache(False, offload=False), cache(True, gpu_pages=2, watermark=0.5)
    no_append = cache(True, fused_append=False, offload=False)
    worst, identical = drive([fused, apart, off, no_append], [3 * T] + [1] * 6, seed=11)
    assert worst < 1e-5 and identical
    assert fused.ops.fused_launches == 2 * 6 and apart.ops.fused_launches == 0     # every layer's decode steps
    assert fused.ops.fused_append_launches == 2 * 6 and no_append.ops.fused_append_launches == 0
    assert no_append.ops.fused_launches == 2 * 6 and not fused._rows
    t = off.pool.page_table(off._seq)
    assert any(not t.on_device(i) for i in range(t.n_pages)) and off.ops.fused_launches < 2 * 6
    assert off.ops.fused_append_launches == off.ops.fused_launches    # the host-page steps appended on their own
    assert not fused._counters.any()


def test_gpu_decode_batch_equals_each_sequence_alone():
    """GpuDecodeBatch (Stage.forward_batch's attention on GPU caches: one launch a layer for every sequence) against
    twin caches' own append + attend: the same output bits per sequence, padding rows zero (also once a smaller batch
    reuses the buffer), the same pages afterwards, advance()'s invariants held, one launch per layer."""
    from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
    ops = EmulatedOps(num_sms=2)
    kw = dict(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256, staging_pages=4, ops=ops)
    prompts = (3, 17, 8)                       # the new rows cross page boundaries at different steps
    batched, alone = [KVCacheGPU(**kw) for _ in prompts], [KVCacheGPU(**kw) for _ in prompts]
    rng = np.random.default_rng(5)
    for n, a, b in zip(prompts, batched, alone):
        for layer in range(2):
            k, v = rng.standard_normal((2, n, H_KV, D)).astype(np.float32)
            q = rng.standard_normal((n, H_KV * GROUP, D)).astype(np.float32)
            for c in (a, b):
                c.append(layer, k, v)
                c.attend(layer, q, 0.2)
        a.advance(n)
        b.advance(n)
    batch = GpuDecodeBatch(H_KV * GROUP, D, lambda t: t, lambda a: a)
    assert GpuDecodeBatch.applies(batched, H_KV * GROUP * D)
    S, steps = 4, 0
    for B in (3,) * 10 + (2,) * 3:                 # row 2 written, then padding: it must read zero again
        for layer in range(2):
            q = rng.standard_normal((S, H_KV * GROUP * D)).astype(np.float16)
            k, v = rng.standard_normal((2, S, H_KV * D)).astype(np.float16)
            got = batch.attend(batched[:B], layer, q, k, v, 0.2)
            assert got is not None and got.shape == (S, H_KV * GROUP * D) and not got[B:].any()
            for b, c in enumerate(alone[:B]):
                c.append(layer, k[b:b + 1], v[b:b + 1])
                want = c.attend(layer, q[b:b + 1], 0.2).reshape(-1)
                assert np.array_equal(got[b].view(np.uint16), want.view(np.uint16)), (B, layer, b)
        for c in batched[:B] + alone[:B]:
            c.advance(1)
        steps += 1
    assert ops.batch_launches == 2 * steps
    for a, b in zip(batched, alone):
        assert a.length == b.length and np.array_equal(np.asarray(a.gpu_store).view(np.uint16),
                                                        np.asarray(b.gpu_store).view(np.uint16))


def test_gpu_decode_batch_falls_back_where_a_step_reads_host_pages():
    """A sequence whose step reads pages on the host (offload past the watermark) is not one launch: attend returns
    None with every cache's step opened, and the per-sequence append + attend (Stage.attend_rows) completes it."""
    from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
    ops = EmulatedOps(num_sms=2)
    kw = dict(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256, staging_pages=4, ops=ops)
    caches = [KVCacheGPU(**kw), KVCacheGPU(**kw, gpu_pages=2, watermark=0.01)]
    rng = np.random.default_rng(6)
    for c in caches:
        for layer in range(2):
            c.append(layer, *rng.standard_normal((2, 40, H_KV, D)).astype(np.float32))
        c.advance(40)
    batch = GpuDecodeBatch(H_KV * GROUP, D, lambda t: t, lambda a: a)
    assert GpuDecodeBatch.applies(caches, H_KV * GROUP * D)
    for layer in range(2):
        q = rng.standard_normal((2, H_KV * GROUP * D)).astype(np.float16)
        k, v = rng.standard_normal((2, 2, H_KV * D)).astype(np.float16)
        assert batch.attend(caches, layer, q, k, v, 0.2) is None
        assert all(c._pending == 1 for c in caches)
        for b, c in enumerate(caches):
            c.append(layer, k[b:b + 1], v[b:b + 1])
            assert np.isfinite(c.attend(layer, q[b:b + 1], 0.2).astype(np.float32)).all()
    for c in caches:
        c.advance(1)
    assert ops.batch_launches == 0 and all(c.length == 41 for c in caches)


def test_gpu_decode_batch_table_stays_at_one_address_per_batch_and_is_rewritten_each_step():
    """What a CUDA graph of a batched step (runtime/hybrid/batch_graph.py) relies on: prepare() opens every cache's
    step and writes the step's table before any launch, into one device buffer per sequence count whose address
    never changes, with the contents a table built from scratch has (page addresses, steps and splits of this step,
    as the caches cross page boundaries); the layers' launches then reuse that table."""
    from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
    ops = EmulatedOps(num_sms=2)
    kw = dict(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256, staging_pages=4, ops=ops)
    caches = [KVCacheGPU(**kw) for _ in range(3)]
    rng = np.random.default_rng(7)
    for n, c in zip((5, 6, 13), caches):                    # each crosses a page boundary within the steps below
        for layer in range(2):
            c.append(layer, *rng.standard_normal((2, n, H_KV, D)).astype(np.float32))
        c.advance(n)
    batch = GpuDecodeBatch(H_KV * GROUP, D, lambda t: t, lambda a: a)
    where, contents = {}, []
    for B in (3, 3, 3, 3, 2, 2, 3):
        step = batch.prepare(caches[:B], 4)
        assert step.rows is not None and all(c._pending == 1 for c in caches[:B])
        where.setdefault(B, set()).add(ops.ptr(step.rows))
        fresh = GpuDecodeBatch(H_KV * GROUP, D, lambda t: t, lambda a: a)._step_table(caches[:B])
        assert ops.ptr(fresh.rows) != ops.ptr(step.rows)
        assert np.array_equal(np.asarray(step.rows), np.asarray(fresh.rows)) and step.max_splits == fresh.max_splits
        contents.append(np.asarray(step.rows).copy())
        for layer in range(2):
            q = rng.standard_normal((4, H_KV * GROUP * D)).astype(np.float16)
            k, v = rng.standard_normal((2, 4, H_KV * D)).astype(np.float16)
            assert batch.attend(caches[:B], layer, q, k, v, 0.2) is not None
            assert batch._step is step                      # the layers' launches read the prepared table
        for c in caches[:B]:
            c.advance(1)
    assert {B: len(a) for B, a in where.items()} == {3: 1, 2: 1}
    assert not all(np.array_equal(contents[0], c) for c in contents[1:4]), "the page crossings changed no table row"


def test_short_contexts_take_the_short_kernel_and_offload_keeps_its_bits():
    """Up to decode_splits.short_path's page count (here 2 pages: half the 4 staging slots) a decode step is one
    paged_decode_short launch per layer, its row appended in it; with a page evicted to the host the step stages it
    and still runs the short kernel, so offload changes no bit; past that page count the split kernels run. A cubin
    without the short kernels keeps the split path throughout, within the same tolerance."""
    def cache(short=None, **kw):
        return KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=256, staging_pages=4,
                          ops=EmulatedOps(num_sms=2, short=short), **kw)
    resident, off, old = cache(offload=False), cache(gpu_pages=2, watermark=0.5), cache(short=False, offload=False)
    steps = [T - 3] + [1] * 8                      # 5 tokens of prompt, then decode up to 2 pages (13 tokens)
    worst, identical = drive([resident, off], steps, seed=13)
    t = off.pool.page_table(off._seq)
    print(f"\nshort decode: max error {worst:.2e}; offload bit-identical {identical}; short launches "
          f"{resident.ops.short_launches} / {off.ops.short_launches}; host pages at the end "
          f"{sum(not t.on_device(i) for i in range(t.n_pages))}")
    assert worst < 1e-5 and identical
    assert resident.ops.short_launches == off.ops.short_launches == 2 * 8 and resident.ops.fused_launches == 0
    assert any(not t.on_device(i) for i in range(t.n_pages)) and not resident._rows
    worst_old, _ = drive([old], steps, seed=13)
    assert worst_old < 1e-5 and old.ops.short_launches == 0 and old.ops.fused_append_launches == 2 * 8
    drive([resident], [1] * 4, seed=14)            # 14-16 tokens: 2 pages; 17: 3 pages, the split kernels
    assert resident.ops.short_launches == 2 * 11 and resident.ops.fused_launches == 2 * 1


def test_per_layer_windows():
    """Gemma 3's interleaving on the GPU cache: each layer its own window (0: the whole context), its decode kernels
    reading their window's [n_tokens, t_begin], with pages on the host and without."""
    for kw in ({"gpu_pages": 3, "watermark": 0.5}, {"offload": False}):
        c = make(sliding_window=(11, 0), **kw)
        worst = drive_windows(c, [19] + [1] * 12 + [3, 1], seed=4, windows=(11, 0))
        assert worst < 1e-5, (kw, worst)
    from helmc.errors import HelmcError
    for bad in ((11,), (11, -1)):
        with pytest.raises(HelmcError, match="sliding_window expected None, >= 0 or 2 per-layer windows"):
            make(sliding_window=bad)


def test_graph_key_names_each_windows_first_split():
    """A decode step with sliding windows replays a CUDA graph too: its key names each window's first split (a
    launch argument from the host), so a graph is captured again only when a window's first split moves."""
    c = make(offload=False, sliding_window=(11, 0))
    rng = np.random.default_rng(6)
    seen = []
    for S in [19] + [1] * 30:
        if S == 1:
            c.begin_step(1)
            key = c.graph_key()
            span = c._split_plan(c._table())[0]
            assert key is not None and key[3] == (0, max(0, c.length + 1 - 11) // span), (c.length, key)
            seen.append(key[3])
        for layer in range(2):
            k, v = rng.standard_normal((2, S, H_KV, D)).astype(np.float32)
            c.append(layer, k, v)
            c.attend(layer, rng.standard_normal((S, H_KV * GROUP, D)).astype(np.float32), 0.2)
        c.advance(S)
    assert len(set(seen)) > 1          # the window's first split moved over these steps


def drive_windows(cache, steps, seed, windows):
    """drive() for one cache whose layers have windows of their own: each layer against its own reference."""
    rng = np.random.default_rng(seed)
    hist = [[np.zeros((0, H_KV, D), np.float16)] * 2 for _ in windows]
    worst = 0.0
    for S in steps:
        for layer, w in enumerate(windows):
            k, v = rng.standard_normal((2, S, H_KV, D)).astype(np.float32)
            q = rng.standard_normal((S, H_KV * GROUP, D)).astype(np.float32)
            cache.append(layer, k, v)
            o = cache.attend(layer, q, 0.2)
            hist[layer] = [np.concatenate([hist[layer][0], k.astype(np.float16)]),
                           np.concatenate([hist[layer][1], v.astype(np.float16)])]
            ref = full_attention(q.astype(np.float16) if S == 1 else q, hist[layer][0], hist[layer][1], 0.2, window=w)
            scale = 1e-5 / DECODE_TOL if S == 1 else 1.0
            worst = max(worst, scale * float(np.abs(o.astype(np.float64) - ref).max() / np.abs(ref).max()))
        cache.advance(S)
    return worst
