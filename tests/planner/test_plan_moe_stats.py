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
from helmc.planner.moe import HOST_WAIT_UNPRICED, UNIFORM_ROUTING
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


def halved(stats: ExpertStats, first: np.ndarray, tokens: int) -> ExpertStats:
    return dataclasses.replace(stats, first_half=tuple(tuple(int(c) for c in row) for row in first),
                               first_half_tokens=tokens)


def test_the_hit_rate_is_predicted_on_the_half_that_did_not_choose_the_experts(spec):
    """Spread routing: every token picks 8 of 128 uniformly. The 16 experts most often picked in a sample take more
    of that sample than 16/128 by chance alone; on the other half they take ~16/128, as decode found (0.26 planned
    in sample against 0.08 measured on the H200 host). Skewed routing keeps its hot experts hot on both halves."""
    rng = np.random.default_rng(3)
    E, k, T = spec.moe.num_experts, spec.moe.top_k, 512
    sel = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(T)]) for _ in range(spec.num_layers)])
    counts = np.stack([np.bincount(s.reshape(-1), minlength=E) for s in sel])          # [L, E]
    first = np.stack([np.bincount(s[:T // 2].reshape(-1), minlength=E) for s in sel])  # [L, E]
    base = ExpertStats(EXPERT_STATS_FORMAT_VERSION, E, k, T, tuple(tuple(int(c) for c in r) for r in counts),
                       "calibrate", "test")
    stats = halved(base, first, T // 2)
    assert ExpertStats.from_json(stats.to_json()) == stats
    in_sample = np.mean([base.mass(i, base.hottest(i, 16)) for i in range(spec.num_layers)])
    held_out = np.mean([stats.predicted_mass(i, 16) for i in range(spec.num_layers)])
    assert in_sample > 0.16 and abs(held_out - 16 / E) < 0.02, (in_sample, held_out)
    p_in = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=8, expert_stats=base)
    p_out = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=8, expert_stats=stats)
    assert p_out.placement.gpu_experts == p_in.placement.gpu_experts                 # the same experts held
    n = len(p_out.placement.gpu_experts[0])
    assert p_out.predictions.expert_hit_rate == pytest.approx(n / E, abs=0.01)       # what holding n of E gives
    assert p_out.predictions.expert_hit_rate < p_in.predictions.expert_hit_rate
    assert p_out.predictions.t_plan_ms > p_in.predictions.t_plan_ms                  # more left to the CPU
    skewed = skewed_stats(spec)
    half = np.array([[c // 2 for c in row] for row in skewed.counts])
    fix = TOKENS // 2 * k - half.sum(axis=1)                                         # make each row's sum exact
    half[np.arange(len(half)), np.argmax(half, axis=1)] += fix
    hot = halved(skewed, half, TOKENS // 2)
    for i in range(spec.num_layers):
        assert hot.predicted_mass(i, 16) == pytest.approx(skewed.mass(i, skewed.hottest(i, 16)), abs=0.01)


def test_bad_halves_are_one_line(spec):
    stats = skewed_stats(spec, seed=1)
    with pytest.raises(HelmcError, match="expected first-half counts of 0 < first_half_tokens < 1000 tokens"):
        halved(stats, np.array(stats.counts), 1000)
    over = np.array(stats.counts)
    over[0, 0] += 1
    with pytest.raises(HelmcError, match="block 0 expected first-half counts between 0 and the block's counts"):
        halved(stats, over, 500)


def test_a_plan_with_host_experts_on_the_gpu_stage_says_their_wait_is_not_priced(spec):
    """A GPU stage whose routed blocks keep experts on the host waits for the host at each of them every step; the
    plan says that time is not priced (its prediction is low), and says nothing of it where every expert is in VRAM."""
    split = plan(spec, "h200-profiled", prompt_len=2048, output_len=64, gpu_budget_gib=8)
    whole = plan(spec, "h200-profiled", prompt_len=2048, output_len=64)
    assert split.placement.uses_gpu and 0 < len(split.placement.gpu_experts[0]) < 128
    assert HOST_WAIT_UNPRICED in split.predictions.fallbacks
    assert [len(ids) for ids in whole.placement.gpu_experts] == [128] * 48
    assert HOST_WAIT_UNPRICED not in whole.predictions.fallbacks
    assert HOST_WAIT_UNPRICED in format_plan_table(split, spec)                 # printed with the plan


def test_a_calibrated_host_half_is_charged_at_each_block_that_waits_for_the_host(spec):
    """gpu.moe_host_half_ms (helmc calibrate's measure of the host's half at a routed decode block): the plan charges it
    once a step per routed GPU block whose experts are not all in VRAM, and no longer says that wait is unpriced; a
    plan with every expert in VRAM (routed on the GPU) is charged nothing."""
    from helmc.hardware.profile import load_hardware
    hw = load_hardware("h200-profiled")
    timed = dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, moe_host_half_ms=0.05))
    split, split_timed = (plan(spec, h, prompt_len=2048, output_len=64, gpu_budget_gib=8) for h in (hw, timed))
    assert split_timed.placement == split.placement
    waiting = sum(1 for ids in split.placement.gpu_experts if 0 < len(ids) < 128)
    assert waiting == 48
    assert split_timed.predictions.t_plan_ms == pytest.approx(split.predictions.t_plan_ms + waiting * 0.05, abs=1e-6)
    assert HOST_WAIT_UNPRICED not in split_timed.predictions.fallbacks
    whole, whole_timed = (plan(spec, h, prompt_len=2048, output_len=64) for h in (hw, timed))
    assert whole_timed.predictions.t_plan_ms == pytest.approx(whole.predictions.t_plan_ms, abs=1e-9)
