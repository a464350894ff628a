"""Routing statistics in the plan of a mixture of experts (helmc/planner/moe.py): with an ExpertStats the plan holds
each routed block's most often selected experts in VRAM and predicts the hit rate as the share of selections they
took; without, it holds the lowest indices and names uniform routing in Plan.predictions.fallbacks. Qwen3-30B-A3B's published
configuration on the H200 preset, skewed counts made here: pure Python, no weights, no TVM."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.planner.moe import UNIFORM_ROUTING
from helmc.planner.plan_table import format_plan_table
from helmc.planner.search_partition import plan
from helmc.runtime.bundle.expert_stats import EXPERT_STATS_FORMAT_VERSION, ExpertStats
from helmc.runtime.bundle.plan import Plan

from test_plan_moe import CONFIG

TOKENS = 1000


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_hf_config(CONFIG)


def skewed_stats(spec, seed=0) -> ExpertStats:
    """Counts drawn from a Zipf-like routing, a different order of experts in every block."""
    rng = np.random.default_rng(seed)
    E, k = spec.moe.num_experts, spec.moe.top_k
    counts = []
    for _ in range(spec.num_layers):
        p = 1.0 / np.arange(1, E + 1) ** 1.1
        p = p[rng.permutation(E)]
        p /= p.sum()
        rows = np.zeros(E, np.int64)
        for _ in range(TOKENS):
            rows[rng.choice(E, size=k, replace=False, p=p)] += 1
        counts.append(tuple(int(c) for c in rows))
    return ExpertStats(EXPERT_STATS_FORMAT_VERSION, E, k, TOKENS, tuple(counts), "calibrate", "test")


@pytest.mark.parametrize("budget", [8, 12])
def test_the_hottest_experts_go_to_vram_and_predict_their_mass(spec, budget):
    stats = skewed_stats(spec)
    uniform = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=budget)
    p = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=budget, expert_stats=stats)
    n = len(p.placement.gpu_experts[0])
    assert 0 < n < 128 and {len(ids) for ids in p.placement.gpu_experts} == {n}
    assert [len(ids) for ids in uniform.placement.gpu_experts] == [n] * 48      # the same VRAM, other experts
    masses = []
    for i, ids in enumerate(p.placement.gpu_experts):
        row = stats.counts[i]
        assert list(ids) == sorted(ids)
        assert min(row[e] for e in ids) >= max(row[e] for e in range(128) if e not in ids)   # none cooler held
        masses.append(sum(row[e] for e in ids) / (TOKENS * 8))
    assert p.predictions.expert_hit_rate == pytest.approx(np.mean(masses), rel=1e-12)
    assert uniform.predictions.expert_hit_rate == pytest.approx(n / 128)
    assert p.predictions.expert_hit_rate > uniform.predictions.expert_hit_rate
    assert p.predictions.t_plan_ms < uniform.predictions.t_plan_ms                             # fewer expert bytes left to the CPU
    assert UNIFORM_ROUTING in uniform.predictions.fallbacks and UNIFORM_ROUTING not in p.predictions.fallbacks
    assert Plan.from_json(p.to_json()) == p
    table = format_plan_table(p, spec)
    assert f"predicted hit rate {p.predictions.expert_hit_rate:.2f} (routing statistics)" in table
    assert "(uniform routing)" in format_plan_table(uniform, spec)


def test_stats_round_trip_and_bad_files_are_one_line(spec):
    stats = skewed_stats(spec, seed=1)
    assert ExpertStats.from_json(stats.to_json()) == stats
    d = dataclasses.asdict(stats)
    with pytest.raises(HelmcError, match=r"unknown key\(s\) \['extra'\]"):
        ExpertStats.from_json(stats.to_json()[:-1] + ', "extra": 1}')
    with pytest.raises(HelmcError, match="block 2 expected non-negative counts summing to tokens x top_k = 8000"):
        ExpertStats(**{**d, "counts": d["counts"][:2] + ((1,) * 128,) + d["counts"][3:]})
    with pytest.raises(HelmcError, match="block 0 expected 128 counts, found 3"):
        ExpertStats(**{**d, "counts": ((1, 2, 3),)})
    with pytest.raises(HelmcError, match="expected valid JSON"):
        ExpertStats.from_json("{")
    short = ExpertStats(**{**d, "counts": d["counts"][:40]})
    with pytest.raises(HelmcError, match="expert stats: expected 128 experts, top-8, 48 blocks"):
        plan(spec, "h200-profiled", gpu_budget_gib=8, expert_stats=short)
