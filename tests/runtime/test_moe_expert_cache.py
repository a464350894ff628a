"""The VRAM expert cache's bookkeeping (runtime/moe_expert_cache.ExpertResidency) with exact expert ids: which
expert holds each slot, the decayed counts, the promotions a refresh decides, no swap on ties, an expert mid-copy
served by the CPU, slot_of and the slot table inverse after every move."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helmc.errors import HelmcError
from helmc.runtime.bundle.plan import Plan
from helmc.runtime.moe_expert_cache import ExpertCacheOptions, ExpertResidency

E = 8


def residency(initial=(0, 3), **options) -> ExpertResidency:
    return ExpertResidency(E, initial, ExpertCacheOptions(**options))


def feed(r: ExpertResidency, rows: list[list[int]]) -> None:
    for row in rows:
        r.observe(np.array([row]))


def test_starts_as_the_plan_places_them():
    r = residency((5, 1, 6))
    assert r.slot_expert.tolist() == [5, 1, 6]
    assert r.slot_of.tolist() == [-1, 1, -1, -1, -1, 0, 2, -1]
    assert r.resident() == {1, 5, 6} and r.in_flight() == []


def test_the_hottest_host_expert_replaces_the_coldest_slot():
    r = residency((0, 3), refresh_tokens=4, margin=1.0, decay=0.5)
    feed(r, [[3, 6], [3, 6], [3, 6], [0, 3]])        # counts: 0 -> 1, 3 -> 4, 6 -> 3
    assert r.due()
    assert r.decide() == [(0, 6)]                     # slot 0 (expert 0, count 1) loses to 6 (3 > 1 + 1)
    assert r.counts[[0, 3, 6]].tolist() == [0.5, 2.0, 1.5] and r.tokens == 0 and not r.due()
    r.begin(0, 6)
    assert r.slot_of[0] == -1 and r.slot_of[6] == -1, "the old expert and the incoming one run on the CPU"
    assert r.slot_expert.tolist() == [-1, 3] and r.incoming.tolist() == [6, -1] and r.in_flight() == [0]
    r.observe(np.array([[6, 0]]))
    assert r.hits == 5 and r.selections == 10          # 3 four times and 0 once before; 6 and 0 now on the CPU
    r.complete(0)
    assert r.slot_expert.tolist() == [6, 3] and r.slot_of[6] == 0 and r.slot_of[0] == -1 and r.promotions == 1
    r.observe(np.array([[6, 3]]))
    assert r.hits == 7 and r.hit_rate() == 7 / 12
    assert r.selected.tolist() == [2, 0, 0, 5, 0, 0, 5, 0]


def test_equal_counts_never_swap_and_the_margin_holds_back():
    r = residency((0, 1), refresh_tokens=2, margin=0.0)
    feed(r, [[0, 2], [1, 2]])                         # 2: 2, 0: 1, 1: 1
    assert r.decide() == [(0, 2)]
    r = residency((0, 1), refresh_tokens=2, margin=0.0)
    feed(r, [[0, 2], [0, 2]])                         # 2 and 0 tie at 2; slot 1 (expert 1, count 0) is colder
    assert r.decide() == [(1, 2)]
    r = residency((0, 1), refresh_tokens=2, margin=0.0)
    feed(r, [[0, 1], [2, 3]])                         # every count 1: nothing moves
    assert r.decide() == []
    r = residency((0, 1), refresh_tokens=2, margin=2.0)
    feed(r, [[2, 3], [2, 3]])                         # 2 beats 0 by 2, not by more
    assert r.decide() == []


def test_at_most_max_promotions_hottest_first():
    r = residency((0, 1, 2), refresh_tokens=3, margin=0.5, max_promotions=2)
    feed(r, [[5, 6], [5, 6], [5, 7]])                 # 5: 3, 6: 2, 7: 1; slots' experts all 0
    assert r.decide() == [(0, 5), (1, 6)]
    r = residency((0, 1, 2), refresh_tokens=3, margin=0.5, max_promotions=0)
    feed(r, [[5, 6], [5, 6], [5, 7]])
    assert r.decide() == [] and r.tokens == 0


def test_decay_forgets_old_selections():
    r = residency((0,), refresh_tokens=1, margin=0.0, decay=0.25)
    r.observe(np.array([[0, 1], [0, 2]]))             # a batched step's two rows: 0: 2, 1: 1, 2: 1
    assert r.tokens == 2 and r.decide() == [] and r.counts[:3].tolist() == [0.5, 0.25, 0.25]
    r.observe(np.array([[4, 5]]))                     # 4: 1 > 0.5: promoted at the next decision
    assert r.decide() == [(0, 4)]
    assert r.counts[0] == pytest.approx(0.125) and r.counts[4] == pytest.approx(0.25)


def test_a_slot_mid_copy_is_neither_cold_nor_a_target():
    r = residency((0, 1), refresh_tokens=1, margin=0.0, max_promotions=2)
    r.observe(np.array([[4, 5]]))
    moves = r.decide()
    assert moves == [(0, 4), (1, 5)]
    r.begin(*moves[0])
    r.observe(np.array([[6, 7]]))      # 4 (incoming) is no candidate; slot 0 (busy) is none either
    assert r.decide() == [(1, 6)]
    with pytest.raises(AssertionError):
        r.begin(0, 7)                  # slot 0 is receiving expert 4
    with pytest.raises(AssertionError):
        r.begin(1, 4)                  # 4 is already on its way into slot 0
    with pytest.raises(AssertionError):
        r.complete(1)                  # slot 1 is receiving nothing


def test_forget_drops_the_counts_and_keeps_the_slots():
    r = residency((0, 3), refresh_tokens=4)
    feed(r, [[5, 6]] * 3)
    r.forget()
    assert r.counts.sum() == 0 and r.selected.sum() == 0 and r.tokens == r.selections == r.hits == 0
    assert r.slot_expert.tolist() == [0, 3] and not r.due()


def test_disabled_counts_hits_and_never_decides():
    r = residency((0, 3), enabled=False, refresh_tokens=1)
    feed(r, [[3, 6]] * 5)
    assert not r.due() and r.counts.sum() == 0 and r.hit_rate() == 0.5
    assert r.selected.tolist() == [0, 0, 0, 5, 0, 0, 5, 0]


def test_bad_options_and_slots_are_refused():
    for bad in (dict(refresh_tokens=0), dict(decay=1.5), dict(margin=-1.0), dict(max_promotions=-1)):
        with pytest.raises(HelmcError, match="expert cache"):
            ExpertCacheOptions(**bad)
    with pytest.raises(HelmcError, match="distinct experts"):
        ExpertResidency(E, (1, 1))
    with pytest.raises(HelmcError, match="distinct experts"):
        ExpertResidency(E, (8,))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, E - 1), min_size=2, max_size=2), min_size=1, max_size=80),
       st.integers(1, 4), st.integers(0, 3), st.floats(0.0, 2.0))
def test_any_sequence_keeps_the_maps_inverse(rows, slots, promotions, margin):
    r = residency(tuple(range(slots)), refresh_tokens=3, margin=margin, max_promotions=promotions)
    for i, row in enumerate(rows):
        r.observe(np.array([row]))
        if i % 2 and r.in_flight():               # copies complete a token later, sometimes
            r.complete(r.in_flight()[0])
        if r.due():
            for slot, e in r.decide():
                r.begin(slot, e)
        r.check()
        assert len(r.resident()) + len(r.in_flight()) == slots
    for s in r.in_flight():
        r.complete(s)
    assert sorted(r.resident()) == sorted(r.slot_expert.tolist()) and len(r.resident()) == slots


def test_the_plan_says_whether_the_cache_runs():
    """Plan.placement.expert_cache: off unless the plan turns it on; kept through the plan's JSON (a plan written
    before it reads as off)."""
    plan = Plan.of(num_layers=2, cpu_units=0, t_cpu_ms=0.0, t_gpu_ms=2.0, t_comm_ms=0.0, t_plan_ms=2.0,
                   gpu_experts=((0, 3), (1,)))
    assert plan.placement.expert_cache is False
    on = plan.replace(expert_cache=True)
    assert Plan.from_json(on.to_json()).placement.expert_cache is True
    assert Plan.from_json(plan.to_json()).placement == plan.placement
    d = json.loads(on.to_json())
    del d["placement"]["expert_cache"]
    assert Plan.from_json(json.dumps(d)).placement.expert_cache is False


def test_a_requests_json_carries_the_expert_counts_only_for_experts():
    from helmc.runtime.session import GenerationResult
    dense = GenerationResult([1, 2], [3]).to_json_dict()
    assert not any(k.startswith("expert") or k == "predicted_hit_rate" for k in dense)
    moe = GenerationResult([1, 2], [3], experts={"expert_cache_hit_rate": 0.75, "predicted_hit_rate": 0.5,
                                                  "expert_cache": True, "expert_cache_promotions": 2}).to_json_dict()
    assert moe["expert_cache_hit_rate"] == 0.75 and moe["predicted_hit_rate"] == 0.5 and moe["tokens"] == [3]
