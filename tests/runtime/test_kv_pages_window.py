"""Sliding-window page release (runtime/kv/pages.py release_before): exact page ids and slots as a sliding layer
kind's window moves on. Free slots go lowest first and page ids are never reused, so every id is determined."""
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv.pages import PagePool, Residency

G, H, F = Residency.GPU, Residency.HOST, Residency.IN_FLIGHT


def table(pool, sid):
    t = pool.page_table(sid)
    return t.first_page, list(zip(t.page_ids, t.host_slots))


def test_window_release_exact_ids_host_pool():
    pool = PagePool(page_tokens=4, gpu_capacity=0, host_capacity=8)
    s = pool.add_sequence()
    assert pool.reserve(s, 10) == (0, 1, 2)                  # tokens 0..9: pages 0-2 in slots 0-2
    pool.advance(s, 10)
    assert pool.release_before(s, 3) == ()                   # page 0 (0..3) is not wholly before 3
    assert pool.release_before(s, 4) == (0,)                 # now it is: slot 0 back
    assert table(pool, s) == (1, [(1, 1), (2, 2)]) and pool.host_free == 6
    assert pool.release_before(s, 4) == ()                   # releasing again changes nothing
    assert pool.reserve(s, 3) == (3,)                        # tokens 10..12: page 3 takes the freed slot 0
    pool.advance(s, 3)
    assert table(pool, s) == (1, [(1, 1), (2, 2), (3, 0)])
    assert pool.page_info(3).index == 3 and pool.page_table(s).tokens_in(3) == 1
    assert pool.release_before(s, 12) == (1, 2)              # pages 1, 2 (4..11) wholly before 12
    assert table(pool, s) == (3, [(3, 0)]) and pool.first_page(s) == 3
    assert pool.reserve(s, 8) == (4, 5)                      # tokens 13..20: pages 4, 5 in slots 1, 2
    assert table(pool, s) == (3, [(3, 0), (4, 1), (5, 2)])
    pool.advance(s, 8)
    pool.free_sequence(s)
    assert pool.host_free == 8


def test_release_with_a_gpu_tier_and_bad_input():
    pool = PagePool(page_tokens=4, gpu_capacity=2, host_capacity=4, gpu_watermark_pages=2)
    s = pool.add_sequence()
    assert pool.reserve(s, 12) == (0, 1, 2)                  # the oldest page straight to the host
    pool.advance(s, 12)
    t = pool.page_table(s)
    assert list(zip(t.page_ids, t.residency, t.gpu_slots, t.host_slots)) == \
        [(0, H, None, 0), (1, G, 0, None), (2, G, 1, None)]
    assert pool.release_before(s, 9) == (0, 1)              # a HOST page and a GPU page, slots back
    assert pool.gpu_free == 1 and pool.host_free == 4
    assert pool.reserve(s, 1) == (3,) and pool.page_table(s).gpu_slots == (1, 0)
    pool.advance(s, 1)
    with pytest.raises(HelmcError, match="committed"):       # position beyond the committed tokens
        pool.release_before(s, 14)
    pool.reserve(s, 3)
    with pytest.raises(HelmcError, match="committed"):       # reserved, not committed
        pool.release_before(s, 16)
    pool.advance(s, 3)
    assert pool.begin_eviction(2) == 0                       # page 2 leaving: IN_FLIGHT
    with pytest.raises(HelmcError, match="in flight"):
        pool.release_before(s, 12)
    assert pool.page_table(s).first_page == 2                # nothing released by the refusal
    pool.complete_eviction(2)
    assert pool.release_before(s, 12) == (2,)


def test_invariants_catch_a_released_page_not_committed():
    pool = PagePool(page_tokens=4, gpu_capacity=0, host_capacity=4)
    s = pool.add_sequence()
    pool.reserve(s, 8)
    pool.advance(s, 8)
    pool.release_before(s, 4)
    pool._seqs[s].length = 3                                  # corrupt: page 0 released but not all committed
    with pytest.raises(AssertionError, match="I4"):
        pool.check_invariants()
