"""A busy or unsteady host: rounds of one figure that disagree make `helmc profile` measure again, then refuse."""
from __future__ import annotations

import math
import statistics

import pytest

from helmc.errors import HelmcError
from helmc.hardware import host_read as hr


def test_steady_rounds_pass_and_disagreeing_rounds_are_named_worst_first():
    # Round medians as the 2-core EPYC read them idle, and with a memory-bound job beside the profile.
    steady = {"cpu.dram_gbs": [94.8, 93.1, 95.0], "cpu.gemv_reads float16": [92.0, 90.5, 91.7]}
    assert hr.unsteady(steady) == ()
    busy = dict(steady, **{"cpu.dram_gbs": [94.8, 53.6, 92.0], "cpu.gemv_reads q4_k": [55.0, 89.0, 88.0]})
    bad = hr.unsteady(busy)
    assert [b.what for b in bad] == ["cpu.dram_gbs", "cpu.gemv_reads q4_k"]
    assert bad[0].spread == pytest.approx(94.8 / 53.6) and bad[1].spread == pytest.approx(89.0 / 55.0)
    assert "53.6" in bad[0].describe() and "max/min 1.77" in bad[0].describe()


def test_the_limit_is_max_over_min_of_the_rounds():
    assert hr.unsteady({"x": [100.0, 100.0 / hr.SPREAD_LIMIT]}) == ()
    assert [b.what for b in hr.unsteady({"x": [100.0, 100.0 / hr.SPREAD_LIMIT - 0.5]})] == ["x"]
    assert hr.RoundSpread("one round", (50.0,)).spread == 1.0          # a quick profile's single round
    assert math.isinf(hr.RoundSpread("nothing read", (50.0, 0.0)).spread)


def test_refusal_is_one_line_naming_the_figure_and_its_spread():
    worst = hr.RoundSpread("cpu.dram_gbs", (94.8, 53.6, 92.0))
    with pytest.raises(HelmcError) as e:
        hr.refuse_unsteady(worst, hr.SPREAD_ATTEMPTS)
    text = str(e.value)
    assert "\n" not in text and "cpu.dram_gbs" in text and "1.77" in text and "expected a steady host" in text


@pytest.fixture(scope="module")
def quick_kit(host_hardware):
    """The quick kit the session's host profile measured with (from the artifact cache: no compile)."""
    from helmc.compiler.profile_kit import KitTarget, ensure_kit
    from helmc.hardware.kit import ProfileKit
    d = ensure_kit(KitTarget.of_profile(host_hardware, quick=True), progress=lambda m: None)
    return d, ProfileKit.load(d)


def test_real_sweeps_give_each_figure_its_rounds_and_the_check_judges_their_medians(quick_kit):
    kit_dir, kit = quick_kit
    lib = hr.KitLibrary(kit_dir, kit)
    arena = hr.Arena(hr.arena_bytes(kit))
    from helmc.runtime.weights.host_memory import cpu_tensor_over
    buf = cpu_tensor_over(arena.region, (kit.read_elements,), "float32")
    partial = lib.vector((1024,), 0.0)
    read = lib.lib[kit.read_name]
    rounds_of = hr._sweeps(lib, arena, kit, {"dram": (kit.read_elements * 4, lambda: read(buf, partial))},
                           rounds=2, passes=1, progress=lambda m: None)
    gemvs = {(t, m) for t in kit.weight_types for m in kit.rows_measured(t)}
    assert set(rounds_of) == {"dram"} | gemvs
    assert all(len(v) == 2 and all(len(r) == 1 and min(r) > 0 for r in v) for v in rounds_of.values())
    medians = {hr.figure_name(k): [statistics.median(r) for r in v] for k, v in rounds_of.items()}
    assert "cpu.dram_gbs" in medians and "cpu.gemv_reads float16" in medians
    judged = {b.what for b in hr.unsteady(medians)}
    assert judged == {w for w, r in medians.items() if max(r) / min(r) > hr.SPREAD_LIMIT}
    # The same rounds with one of them read at half the rate, as a job beside the profile does.
    dram = medians["cpu.dram_gbs"]
    halved = dict(medians, **{"cpu.dram_gbs": dram + [min(dram) / 2]})
    assert "cpu.dram_gbs" in {b.what for b in hr.unsteady(halved)}


def test_measured_reads_either_agree_across_rounds_or_refuse_in_one_line(quick_kit):
    """On a shared machine either outcome is right; what may not happen is a profile whose rounds disagree."""
    kit_dir, kit = quick_kit
    try:
        r = hr.measure_host_reads(kit_dir, kit, passes=2, rounds=2)
    except HelmcError as e:
        assert "\n" not in str(e) and "max/min" in str(e) and "expected a steady host" in str(e)
        return
    assert r.dram_gbs > 0 and r.host_read_gbs > 0 and all(g.gbs > 0 for g in r.gemv_reads)
