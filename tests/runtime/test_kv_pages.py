"""Page bookkeeping (runtime/kv/pages.py): exact page ids and slots through allocate, evict,
prefetch and free. Free slots go lowest first and page ids are never reused, so every id below is
determined by the sequence of calls."""
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv.pages import PagePool, PoolExhausted, Residency

G, H, F = Residency.GPU, Residency.HOST, Residency.IN_FLIGHT


def table(pool, sid):
    t = pool.page_table(sid)
    return list(zip(t.page_ids, t.residency, t.gpu_slots, t.host_slots))


def test_decode_lifecycle_exact_ids():
    pool = PagePool(page_tokens=4, gpu_capacity=3, host_capacity=4, gpu_watermark_pages=2, staging_slots=2)
    s = pool.add_sequence()
    assert pool.reserve(s, 5) == (0, 1)                       # 5 tokens -> 2 pages, both fit the watermark
    assert table(pool, s) == [(0, G, 0, None), (1, G, 1, None)]
    assert pool.advance(s, 5) == ()                           # 2 GPU pages <= watermark 2
    assert pool.reserve(s, 4) == (2,)                         # tokens 5..8 -> page 2 in GPU slot 2
    assert pool.advance(s, 4) == (0,)                         # 3 > 2: oldest full page 0 starts leaving
    assert table(pool, s) == [(0, F, 0, 0), (1, G, 1, None), (2, G, 2, None)]
    assert pool.gpu_free == 0 and pool.in_flight() == [0]
    assert pool.reserve(s, 3) == ()                           # tokens 9..11 fit page 2
    assert pool.advance(s, 3) == ()                           # IN_FLIGHT does not count: 2 GPU pages
    with pytest.raises(PoolExhausted):                        # page 3 needs a GPU slot: none free yet
        pool.reserve(s, 1)
    assert table(pool, s)[-1][0] == 2                         # ... and nothing changed
    pool.complete_eviction(0)
    assert table(pool, s)[0] == (0, H, None, 0) and pool.gpu_free == 1
    assert pool.reserve(s, 1) == (3,)                         # page 3 takes the freed GPU slot 0
    assert pool.advance(s, 1) == (1,)                         # pages 1, 2, 3 > 2: page 1 starts leaving
    assert table(pool, s)[1] == (1, F, 1, 1)
    pool.complete_eviction(1)
    assert table(pool, s) == [(0, H, None, 0), (1, H, None, 1), (2, G, 2, None), (3, G, 0, None)]
    assert pool.begin_prefetch(1, layer=5) == 0               # lowest free staging slot
    assert pool.begin_prefetch(0, layer=5) == 1
    with pytest.raises(PoolExhausted):
        pool.begin_prefetch(0, layer=6)
    with pytest.raises(HelmcError, match="already staged"):
        pool.end_prefetch(0) or pool.begin_prefetch(0, layer=5)
    pool.end_prefetch(1)
    assert pool.staged() == {}
    pool.free_sequence(s)
    assert pool.gpu_free == 3 and pool.host_free == 4
    s2 = pool.add_sequence()
    assert s2 == 1 and pool.reserve(s2, 1) == (4,)            # page ids are not reused, slots are
    assert table(pool, s2) == [(4, G, 0, None)]


def test_long_append_puts_older_pages_on_host():
    pool = PagePool(page_tokens=4, gpu_capacity=3, host_capacity=8, gpu_watermark_pages=2)
    s = pool.add_sequence()
    assert pool.reserve(s, 3) == (0,)
    pool.advance(s, 3)
    assert pool.gpu_slots_needed(s, 18) == 2
    # tokens 3..20: page 0 gets one more row, pages 1-5 are new; only the newest 2 go to the GPU
    assert pool.reserve(s, 18) == (1, 2, 3, 4, 5)
    assert table(pool, s) == [(0, G, 0, None), (1, H, None, 0), (2, H, None, 1), (3, H, None, 2),
                              (4, G, 1, None), (5, G, 2, None)]
    # committing evicts page 0, which is older than a host page, so the GPU pages are a suffix again
    assert pool.advance(s, 18) == (0,)
    assert table(pool, s)[0] == (0, F, 0, 3)
    pool.complete_eviction(0)
    assert [r[1] for r in table(pool, s)] == [H, H, H, H, G, G]


def test_forced_eviction_is_oldest_first_and_only_full_pages():
    pool = PagePool(page_tokens=2, gpu_capacity=3, host_capacity=3, gpu_watermark_pages=3)
    s = pool.add_sequence()
    pool.reserve(s, 5)
    pool.advance(s, 5)                                        # pages 0, 1 full, page 2 half full
    assert pool.evictable() == [0, 1]
    with pytest.raises(HelmcError, match="oldest first"):
        pool.begin_eviction(1)
    with pytest.raises(HelmcError, match="full"):
        pool.begin_eviction(2)
    assert pool.begin_eviction(0) == 0
    assert pool.begin_eviction(1) == 1
    with pytest.raises(HelmcError, match="in flight"):
        pool.free_sequence(s)
    pool.complete_eviction(0)
    pool.complete_eviction(1)
    with pytest.raises(HelmcError, match="expected in_flight"):
        pool.complete_eviction(1)
    pool.free_sequence(s)


def test_cpu_only_pool_and_bad_input():
    pool = PagePool(page_tokens=4, gpu_capacity=0, host_capacity=2)
    s = pool.add_sequence()
    assert pool.reserve(s, 8) == (0, 1)
    assert table(pool, s) == [(0, H, None, 0), (1, H, None, 1)]
    with pytest.raises(PoolExhausted):
        pool.reserve(s, 1)
    with pytest.raises(HelmcError, match="advance"):
        pool.advance(s, 9)
    assert pool.advance(s, 8) == ()
    with pytest.raises(HelmcError, match="gpu_watermark_pages"):
        PagePool(page_tokens=4, gpu_capacity=2, host_capacity=0, gpu_watermark_pages=3)
    with pytest.raises(HelmcError, match="no sequence"):
        pool.page_table(7)


def test_invariants_catch_corruption():
    pool = PagePool(page_tokens=4, gpu_capacity=2, host_capacity=2, gpu_watermark_pages=1)
    s = pool.add_sequence()
    pool.reserve(s, 4)
    pool._pages[0].gpu_slot = 1                               # slot 0 now neither free nor held
    with pytest.raises(AssertionError, match="I3"):
        pool.check_invariants()
