"""`helmc plan` and `helmc profile` through click's test runner."""
import json
import time

import pytest
from click.testing import CliRunner

from helmc.cli.main import main
from helmc.hardware.profile import HardwareProfile
from helmc.runtime.bundle.plan import Plan
from qwen3_configs import write_config


@pytest.fixture(scope="module")
def q8_dir(tmp_path_factory):
    return write_config(str(tmp_path_factory.mktemp("qwen3-8b")), "Qwen3-8B")


def test_plan_table_marks_the_chosen_row(q8_dir):
    r = CliRunner().invoke(main, ["plan", q8_dir, "rtx4060-laptop", "--no-stream-prefill"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    rows = [l for l in lines if l[:1] in (" ", ">") and l[1:5].strip().isdigit()]
    assert len(rows) == 39                                           # k = 0..38
    chosen = [l for l in rows if l.startswith(">")]
    assert len(chosen) == 1 and chosen[0].split()[1] == "21"
    assert "chosen: cpu(21) -> cuda(17)" in r.output
    t_plan = float(chosen[0].split()[7])                             # T_plan, then tok/s beside it
    assert "tok/s" in lines[3] and chosen[0].split()[8] == f"{1000 / t_plan:.1f}"
    assert f"T_plan {t_plan:.2f} ms = " in r.output and " tok/s (T_cpu" in r.output
    assert "no: VRAM short by" in rows[0] and rows[25].rstrip().endswith("ms")   # feasible rows say by how much they lose
    assert "note: CPU P_dec = M" in r.output                         # the preset's unmeasured figures are said


def test_plan_for_a_batch_says_per_step_and_throughput(q8_dir):
    """--batch 8 (what `helmc serve --max-batch 8` runs): times are per decode step of 8 sequences, and the table
    says the predicted tokens per second in all and per sequence; one sequence keeps ms/token and no such line."""
    r = CliRunner().invoke(main, ["plan", q8_dir, "rtx4060-laptop", "--batch", "8", "--no-hybrid", "--json"])
    t_plan = json.loads(r.output)["t_plan_ms"]
    r = CliRunner().invoke(main, ["plan", q8_dir, "rtx4060-laptop", "--batch", "8", "--no-hybrid"])
    assert r.exit_code == 0, r.output
    assert "times in ms per decode step of 8 sequences" in r.output
    assert f"serving 8 sequences at once: {8000 / t_plan:.1f} tok/s in all, {1000 / t_plan:.2f} each" in r.output
    one = CliRunner().invoke(main, ["plan", q8_dir, "rtx4060-laptop", "--no-hybrid"])
    assert "times in ms/token" in one.output and "serving" not in one.output


def test_plan_json(q8_dir, tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", q8_dir, "rtx4060-laptop", "--json", "-o", str(out), "--no-stream-prefill"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (d["cpu_units"], d["gpu_units"]) == (21, 17)
    assert len(d["candidates"]) == 39 and d["candidates"][21]["feasible"] and not d["candidates"][0]["feasible"]
    assert d["t_plan_ms"] == min(c["t_plan_ms"] for c in d["candidates"] if c["feasible"])
    p = Plan.from_json(out.read_text())
    assert p.placement.cpu_units == 21 and p.predictions.t_plan_ms == d["t_plan_ms"]


def test_plan_options_change_the_plan(q8_dir):
    run = CliRunner().invoke
    base = json.loads(run(main, ["plan", q8_dir, "rtx4060-laptop", "--json"]).output)
    tight = json.loads(run(main, ["plan", q8_dir, "rtx4060-laptop", "--json", "--gpu-budget", "5"]).output)
    long_kv = json.loads(run(main, ["plan", q8_dir, "rtx4060-laptop", "--json", "--no-kv-offload",
                                            "--output-len", "8000"]).output)
    prefill = json.loads(run(main, ["plan", q8_dir, "rtx3090-epyc", "--json", "--objective", "prefill",
                                            "--prompt-len", "512"]).output)
    assert tight["cpu_units"] > base["cpu_units"]
    assert long_kv["cpu_units"] > base["cpu_units"] and long_kv["max_context"] >= 8128
    assert prefill["cpu_units"] == 0


def test_plot_draws_a_png(q8_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "search.png"
    r = CliRunner().invoke(main, ["plan", q8_dir, "rtx4060-laptop", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["search.png"]


def test_64_layer_plan_answers_under_a_second(tmp_path):
    d = write_config(str(tmp_path / "qwen3-32b"), "Qwen3-32B")
    CliRunner().invoke(main, ["plan", d, "rtx3090-epyc", "--no-stream-prefill"])            # imports warm
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["plan", d, "rtx3090-epyc", "--no-stream-prefill"])
    elapsed = time.perf_counter() - t0
    print(f"\nhelmc plan, 64 layers: {elapsed * 1e3:.0f} ms")
    assert r.exit_code == 0 and "cpu(42) -> cuda(24)" in r.output
    assert elapsed < 1.0


def test_errors_exit_2_with_one_line(tmp_path, q8_dir):
    d = write_config(str(tmp_path / "qwen3-32b"), "Qwen3-32B")
    r = CliRunner().invoke(main, ["plan", d, "rtx4060-laptop"])
    assert r.exit_code == 2 and "host RAM short by" in r.output and "VRAM short by" in r.output
    r = CliRunner().invoke(main, ["plan", q8_dir, "no-such-machine"])
    assert r.exit_code == 2 and "rtx4060-laptop" in r.output           # names the presets there are
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "missing"), "rtx4060-laptop"])
    assert r.exit_code == 2 and "config.json" in r.output


def test_profile_command_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "hw.json"
    r = CliRunner().invoke(main, ["profile", "-o", str(out), "--quick", "--gpu-backend", "none"])
    assert r.exit_code == 0, r.output
    assert "cpu:" in r.output and "unmeasured: gpu, link" in r.output
    hw = HardwareProfile.load(str(out))
    assert hw.source == "measured" and hw.cpu.dram_gbs > 0
    small = write_config(str(tmp_path / "two-blocks"), "Qwen3-8B", num_hidden_layers=2)   # fits any test host
    r = CliRunner().invoke(main, ["plan", small, str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["gpu_units"] == 0 and d["candidates"][-1]["t_comm_ms"] == 0.0


def test_profile_kit_built_here_measures_there(tmp_path):
    """`helmc profile --build-kit DIR` (where the compiler is), then `helmc profile --kit DIR` (which needs only the
    TVM runtime): the profile is measured with that kit's kernels and stages, and bad uses say what they expected.
    This machine's quick kit is the one the session's host profile left in the artifact cache (copied, not
    rebuilt), measured quick (the busy-host refusal of a full profile: tests/reliability/test_catalogue_profile.py).
    A kit for another machine (--for) is built, then copied from the cache, in the slow tier, by
    test_kit_for_another_cpu_reports_its_phases."""
    kit = tmp_path / "kit"
    r = CliRunner().invoke(main, ["profile", "--build-kit", str(kit), "--quick", "--gpu-backend", "none"])
    assert r.exit_code == 0, r.output
    assert "built a profile kit in" in r.output and (kit / "profile_kit.json").exists() and (kit / "cpu_bundle").is_dir()
    out = tmp_path / "hw.json"
    r = CliRunner().invoke(main, ["profile", "--kit", str(kit), "-o", str(out), "--quick", "--gpu-backend", "none"])
    assert r.exit_code == 0, r.output
    hw = HardwareProfile.load(str(out))
    assert hw.cpu.host_read_gbs > 0 and hw.cpu.block_overhead_ms is not None
    assert any(n.startswith("overheads: cpu delta") for n in hw.notes)
    for args, message in ((["--for", "rtx4060-laptop"], "--for expected with --build-kit, found it alone"),
                          (["--build-kit", str(kit), "--quick"], "expected a new or empty directory"),
                          # --for reaches the hardware loader: an unknown machine is refused naming the presets
                          (["--build-kit", str(tmp_path / "other"), "--for", "no-such-machine"], "rtx4060-laptop"),
                          (["--kit", str(tmp_path / "none"), "-o", str(out)], "expected profile_kit.json in")):
        r = CliRunner().invoke(main, ["profile"] + args + ["--gpu-backend", "none"])
        assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "other").exists()


@pytest.mark.slow            # a kit with a GPU stage built (LLVM + nvcc)
def test_kit_for_another_cpu_reports_its_phases(tmp_path):
    """A kit for another machine (`helmc profile --build-kit DIR --for rtx4060-laptop`: AVX2, no AVX-512, 14 cores,
    an sm_89 GPU) builds here and runs only on such a CPU; api.build_kit says what it is doing through the progress it
    is given (the CLI gives runtime.progress.Progress: lines on a terminal), and refuses a directory with files in
    it."""
    from helmc import api
    from helmc.errors import HelmcError
    lines, cache = [], str(tmp_path / "cache")
    built = api.build_kit(str(tmp_path / "kit"), "rtx4060-laptop", quick=True, progress=lines.append, cache_dir=cache)
    assert (tmp_path / "kit" / "profile_kit.json").exists() and (tmp_path / "kit" / "gpu_bundle").is_dir()
    # what `helmc profile --build-kit` prints of it: "avx2 kernels for 14 cores, ..., GPU stage for sm_89"
    assert (built.kit.isa, built.target.cores, built.target.gpu_arch) == ("avx2", 14, "sm_89")
    assert built.kit.gpu_arch == "sm_89" and built.kit.gpu_gemv_kernels and "avx512f" not in built.kit.required_flags
    # its GPU decode GEMVs: every weight type's, compiled to an sm_89 cubin, the source left out
    from helmc.hardware.kit import FLOAT_TYPES, GPU_GEMV_DIR, GPU_GEMV_NAME, QUANT_TYPES
    d = tmp_path / "kit" / GPU_GEMV_DIR
    assert (d / f"{GPU_GEMV_NAME}.so").is_file() and (d / f"{GPU_GEMV_NAME}.cubins.json").is_file()
    assert (d / f"{GPU_GEMV_NAME}.sm_89.cubin").read_bytes()[:4] == b"\x7fELF"
    assert not (d / f"{GPU_GEMV_NAME}.cu").exists()
    assert {k.weight_type for k in built.kit.gpu_gemv_kernels} == set(FLOAT_TYPES + QUANT_TYPES)
    assert lines and all(isinstance(line, str) and line for line in lines), lines
    text = "\n".join(lines)
    assert "kernels for avx2" in text and "CPU stage" in text and "GPU stage for sm_89" in text, text
    with pytest.raises(HelmcError, match="--build-kit expected a new or empty directory"):
        api.build_kit(str(tmp_path / "kit"), "rtx4060-laptop", quick=True, progress=lines.append, cache_dir=cache)
    # the same target again: the kit the artifact cache kept, copied, nothing compiled
    again = []
    copied = api.build_kit(str(tmp_path / "again"), "rtx4060-laptop", quick=True, progress=again.append, cache_dir=cache)
    assert copied.kit == built.kit and not any("kernels for" in line or "stage" in line for line in again), again
    assert (tmp_path / "again" / GPU_GEMV_DIR / f"{GPU_GEMV_NAME}.sm_89.cubin").read_bytes() == \
        (d / f"{GPU_GEMV_NAME}.sm_89.cubin").read_bytes()
