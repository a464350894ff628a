"""`helmc calibrate` (thesis 6.4.4): per-device overheads fitted on helmc's own decode step.

CPU tests calibrate a tiny all-CPU bundle built here and check the cost model's use of the fitted
figures by exact arithmetic; nothing is stored, nothing to regenerate. The GPU test needs CuPy, a
GPU and a prebuilt bundle with a GPU stage (the GPU machine has no TVM compiler to build one):
    HELMC_CALIBRATE_BUNDLE=.devrt/b8_split HELMC_CALIBRATE_WEIGHTS=/tmp/helmc-models/qwen3-8b-float16 \
        pytest -m gpu tests/planner/test_calibrate.py
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from helmc.errors import HelmcError
from helmc.hardware.profile import PRESET_DIR, HardwareProfile, list_presets, load_hardware
from tests.gpu_prebuilt import cuda_device

STEPS = 12


def _bare(hw: HardwareProfile) -> HardwareProfile:
    """hw with no overhead at all: the roofline the fits are measured against."""
    gpu = dataclasses.replace(hw.gpu, block_overhead_ms=0.0, step_overhead_ms=0.0) if hw.gpu else None
    return dataclasses.replace(hw, block_overhead_ms=0.0, gpu=gpu,
                               cpu=dataclasses.replace(hw.cpu, block_overhead_ms=0.0, step_overhead_ms=0.0))


@pytest.fixture(scope="module")
def calibrated(tiny, host_hardware):
    from helmc.planner.calibrate import calibrate
    return calibrate(tiny.bundle("qwen3"), host_hardware, steps=STEPS)


def test_tiny_cpu_bundle_gives_positive_finite_deltas(calibrated, host_hardware):
    r = calibrated
    print(r.summary())
    assert [f.device for f in r.fits] == ["cpu"] and r.steps == STEPS
    f = r.fits[0]
    assert f.blocks == 2 and f.distinct_blocks == 2 and f.has_tail        # tiny qwen3: 2 blocks, head on the CPU
    # A tiny block streams ~60 KB: the step is Python + VM + attention, far above its roofline.
    assert f.measured_step_ms > f.roofline_step_ms > 0
    assert math.isfinite(f.block_overhead_ms) and f.block_overhead_ms > 0
    # sigma (per token) is the fit's intercept: on a loaded 2-core machine it came out at -0.05 ms once (in
    # CI); finite and small against the step is what the plan can use
    assert math.isfinite(f.step_overhead_ms) and abs(f.step_overhead_ms) < f.measured_step_ms
    assert f.measured_step_ms == pytest.approx(f.roofline_step_ms + f.blocks * f.block_overhead_ms, rel=1e-12)
    p = r.profile
    assert p.source == "calibrated" and p.gpu is None
    assert p.cpu.block_overhead_ms == round(f.block_overhead_ms, 5)
    assert p.cpu.step_overhead_ms == round(f.step_overhead_ms, 5)
    assert p.cpu.dram_gbs == host_hardware.cpu.dram_gbs                   # rates untouched
    assert any(n.startswith("calibrate: cpu delta") for n in p.notes)
    assert HardwareProfile.from_json(p.to_json()) == p


def test_prediction_adds_each_device_overhead(calibrated, tiny):
    """predict_bundle(calibrated) = the bare roofline + 2 blocks x delta_cpu + sigma_cpu, exactly."""
    from helmc.planner.calibrate import predict_bundle
    from helmc.runtime.measure_bundle import load_bundle_parts
    spec, plan, _, _ = load_bundle_parts(tiny.bundle("qwen3"))
    p = calibrated.profile
    bare = predict_bundle(spec, plan, _bare(p))
    cal = predict_bundle(spec, plan, p)
    print(f"tiny cpu(4): roofline {bare.t_plan_ms:.4f} ms, calibrated T_plan {cal.t_plan_ms:.4f} ms")
    expected = bare.t_plan_ms + 2 * p.cpu.block_overhead_ms + p.cpu.step_overhead_ms
    assert cal.t_plan_ms == pytest.approx(expected, rel=1e-12)
    assert cal.t_gpu_ms == 0.0 and cal.t_comm_ms == 0.0


def test_cost_model_uses_per_device_deltas():
    """The laptop running example: CPU blocks at delta_cpu, GPU blocks at delta_gpu plus sigma_gpu for
    the head on the GPU; an uncalibrated device falls back to the profile-wide delta."""
    from helmc.planner.analyze_program import analyze_program
    from helmc.planner.calibrate import predict_bundle
    from helmc.planner.cost_model import DeviceRates, Workload, stage_time
    from helmc.planner.search_partition import plan as make_plan
    from qwen3_configs import qwen3_spec

    spec = qwen3_spec("Qwen3-8B")
    a = analyze_program(spec)
    base = dataclasses.replace(load_hardware("rtx4060-laptop"), block_overhead_ms=1.0)
    hw = dataclasses.replace(base, cpu=dataclasses.replace(base.cpu, block_overhead_ms=0.25, step_overhead_ms=0.5),
                             gpu=dataclasses.replace(base.gpu, block_overhead_ms=0.0625, step_overhead_ms=0.125))
    w = Workload()
    cpu, gpu = DeviceRates.of_device(hw, "cpu"), DeviceRates.of_device(hw, "gpu")
    assert (cpu.block_overhead_ms, cpu.step_overhead_ms, gpu.block_overhead_ms, gpu.step_overhead_ms) == \
        (0.25, 0.5, 0.0625, 0.125)
    assert stage_time(a, a.stage(0, 21), cpu, w, blend_l3=True).overhead_ms == 20 * 0.25
    assert stage_time(a, a.stage(21, 38), gpu, w, blend_l3=False).overhead_ms == 16 * 0.0625 + 0.125
    assert stage_time(a, a.stage(1, 38), cpu, w, blend_l3=True).overhead_ms == 36 * 0.25 + 0.5   # head on the CPU
    # Not calibrated: the profile-wide delta, no sigma (old profiles predict as before).
    old_gpu = DeviceRates.of_device(base, "gpu")
    assert (old_gpu.block_overhead_ms, old_gpu.step_overhead_ms) == (1.0, 0.0)
    assert DeviceRates.of_gpu(base.gpu, 1.0) == old_gpu
    # A whole split, through predict_bundle (the bench's pure-Python prediction).
    p = make_plan(spec, base, gpu_budget_gib=None)
    n_cpu, n_gpu = len(p.placement.cpu_layers), len(p.placement.gpu_layers)
    assert n_cpu > 0 and n_gpu > 0 and p.placement.head_on_gpu, p.describe()          # a split (cpu(21..22) -> cuda)
    bare = predict_bundle(spec, p, _bare(hw))
    cal = predict_bundle(spec, p, hw)
    assert cal.t_cpu_ms == pytest.approx(bare.t_cpu_ms + n_cpu * 0.25, rel=1e-12)
    assert cal.t_gpu_ms == pytest.approx(bare.t_gpu_ms + n_gpu * 0.0625 + 0.125, rel=1e-12)
    assert cal.t_comm_ms == bare.t_comm_ms
    assert predict_bundle(spec, p, base).t_plan_ms == pytest.approx(p.predictions.t_plan_ms, rel=1e-12)
    # A benchmark's own requests: the plan's workload by default; a longer prompt reads more KV per token.
    assert predict_bundle(spec, p, hw, p.workload.prompt_len, p.workload.output_len) == cal
    longer = predict_bundle(spec, p, hw, prompt_len=8 * p.workload.prompt_len)
    assert longer.t_cpu_ms > cal.t_cpu_ms and longer.t_gpu_ms > cal.t_gpu_ms


def test_old_profiles_still_load_and_new_keys_are_checked():
    assert list_presets()
    for name in list_presets():
        hw = load_hardware(name)
        if hw.cpu.block_overhead_ms is not None:        # measured per device by `helmc profile` (the profiled presets)
            assert hw.block_overhead_on("cpu") == hw.cpu.block_overhead_ms >= 0     # 0: the profile clipped a negative delta
            continue
        assert hw.cpu.block_overhead_ms is None and hw.cpu.step_overhead_ms is None
        assert hw.block_overhead_on("cpu") == hw.block_overhead_ms and hw.step_overhead_on("cpu") == 0.0
        if hw.gpu is not None:
            assert hw.gpu.block_overhead_ms is None and hw.block_overhead_on("gpu") == hw.block_overhead_ms
    h100 = load_hardware("h100-sxm-measured")
    assert h100.block_overhead_on("gpu") == h100.block_overhead_on("cpu") == 1.1425
    with open(os.path.join(PRESET_DIR, "h100-sxm-measured.json")) as f:
        raw = json.load(f)
    raw["gpu"]["blok_overhead_ms"] = 0.1
    with pytest.raises(HelmcError, match="unknown key.*blok_overhead_ms"):
        HardwareProfile.from_json(json.dumps(raw))
    del raw["gpu"]["blok_overhead_ms"]
    raw["gpu"]["block_overhead_ms"] = float("nan")
    with pytest.raises(HelmcError, match="gpu.block_overhead_ms expected a finite number"):
        HardwareProfile.from_json(json.dumps(raw))
    raw["gpu"]["block_overhead_ms"] = -0.01                    # faster than this profile's roofline: allowed
    assert HardwareProfile.from_json(json.dumps(raw)).block_overhead_on("gpu") == -0.01


CLI_PROBE = """
import sys
from helmc.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code in (0, None), e.code
from helmc.runtime.isolation import compiler_modules_loaded
print("LOADED=" + ",".join(compiler_modules_loaded()))
"""


def test_cli_runtime_only_and_bad_paths(tiny, host_hardware, tmp_path):
    from click.testing import CliRunner

    from helmc.cli.main import main
    hw_path = tmp_path / "hw.json"
    host_hardware.save(str(hw_path))
    out = tmp_path / "calibrated.json"
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    p = subprocess.run([sys.executable, "-c", CLI_PROBE, "calibrate", tiny.bundle("qwen3"), str(hw_path), "-o", str(out),
                        "--steps", "4"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "LOADED=", p.stdout
    hw = HardwareProfile.load(str(out))
    assert hw.source == "calibrated" and hw.cpu.block_overhead_ms is not None and hw.cpu.step_overhead_ms is not None

    runner = CliRunner()
    r = runner.invoke(main, ["calibrate", str(tmp_path / "no-bundle"), str(hw_path), "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "bundle: expected a directory, found nothing at" in r.output
    r = runner.invoke(main, ["calibrate", tiny.bundle("qwen3"), str(tmp_path / "no-hw.json"), "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "hardware profile: expected a hardware.json path" in r.output
    r = runner.invoke(main, ["calibrate", tiny.bundle("qwen3"), str(hw_path), "-o", str(tmp_path / "x.json"),
                             "--weights", str(tmp_path / "no-weights")])
    assert r.exit_code == 2 and "calibrate: expected the model's weights" in r.output
    assert not (tmp_path / "x.json").exists()                   # nothing written on failure


@pytest.mark.gpu
def test_calibrate_gpu_bundle_on_the_device():
    cuda_device()
    bundle, weights = os.environ.get("HELMC_CALIBRATE_BUNDLE"), os.environ.get("HELMC_CALIBRATE_WEIGHTS")
    if not bundle or not weights:
        pytest.skip("needs HELMC_CALIBRATE_BUNDLE (a bundle with a GPU stage) and HELMC_CALIBRATE_WEIGHTS")
    from helmc.planner.calibrate import calibrate, predict_bundle
    from helmc.runtime.measure_bundle import load_bundle_parts
    r = calibrate(bundle, os.path.join(bundle, "hardware.json"), weights_dir=weights, steps=16)
    print(r.summary())
    gpu = next(f for f in r.fits if f.device == "gpu")
    assert gpu.has_tail and math.isfinite(gpu.step_overhead_ms) and 0 < gpu.crossing_ms < gpu.measured_tail_ms
    if gpu.blocks:
        assert math.isfinite(gpu.block_overhead_ms) and gpu.measured_step_ms > 0
    assert HardwareProfile.from_json(r.profile.to_json()) == r.profile
    spec, plan, _, _ = load_bundle_parts(bundle, weights)
    t = predict_bundle(spec, plan, r.profile).t_plan_ms
    print(f"{plan.describe()}: T_plan {plan.predictions.t_plan_ms:.2f} ms from the bundle's profile, {t:.2f} ms calibrated")
    assert math.isfinite(t) and t > 0


def test_profile_negative_synthetic_delta_is_clamped():
    """A profile of the GPU machine once fitted -0.79 ms per CPU block (the synthetic stage partly read from L3):
    helmc profile sets it to 0 and says so; the GPU's positive delta stays."""
    import dataclasses
    import os

    from helmc.hardware.profile import PRESET_DIR, HardwareProfile
    from helmc.planner.calibrate import clamp_negative_deltas
    base = HardwareProfile.load(os.path.join(PRESET_DIR, "h100-sxm-profiled.json"))
    hw = dataclasses.replace(base, cpu=dataclasses.replace(base.cpu, block_overhead_ms=-0.79))
    assert hw.cpu.block_overhead_ms < 0 < hw.gpu.block_overhead_ms
    out = clamp_negative_deltas(hw)
    assert out.cpu.block_overhead_ms == 0.0 and out.gpu.block_overhead_ms == hw.gpu.block_overhead_ms
    assert "the cpu delta" in out.notes[-1] and "below 0 set to 0" in out.notes[-1]
    assert all(d.step_overhead_ms is None or d.step_overhead_ms >= 0 for d in (out.cpu, out.gpu))
    assert clamp_negative_deltas(out) == out


def test_a_profile_never_keeps_a_negative_overhead_time():
    """A busy host's synthetic tail can time below the head's roofline: the profile sets such a sigma (and delta) to
    0 and says so, a positive figure is kept, and a profile without negatives comes back unchanged."""
    from helmc.planner.calibrate import clamp_negative_deltas
    hw = load_hardware("h200-profiled")
    neg = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, step_overhead_ms=-0.021, block_overhead_ms=0.004),
                              gpu=dataclasses.replace(hw.gpu, step_overhead_ms=0.05, block_overhead_ms=-0.002))
    out = clamp_negative_deltas(neg)
    assert (out.cpu.step_overhead_ms, out.cpu.block_overhead_ms) == (0.0, 0.004)
    assert (out.gpu.step_overhead_ms, out.gpu.block_overhead_ms) == (0.05, 0.0)
    assert "cpu sigma" in out.notes[-1] and "gpu delta" in out.notes[-1]
    assert clamp_negative_deltas(out) is out
