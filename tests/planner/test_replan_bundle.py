"""`helmc plan BUNDLE hardware.json -o plan.json` then `helmc run BUNDLE --plan plan.json`: a bundle's placement made
again for another machine's profile, run without compiling (planner/replan_bundle.py)."""
import dataclasses
import json

import pytest
from click.testing import CliRunner

from helmc.cli.main import main
from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile, load_hardware
from helmc.planner.replan_bundle import replan_bundle
from helmc.runtime.bundle.plan import Plan


def test_replan_keeps_the_bundles_workload_and_follows_the_profile(tiny, host_hardware, tmp_path):
    bundle = tiny.bundle("qwen3")
    own = Plan.from_json(open(f"{bundle}/plan.json").read())
    p, spec = replan_bundle(bundle, host_hardware)
    assert (p.placement.num_layers, p.workload.batch, p.workload.prompt_len, p.workload.output_len, p.workload.objective) == \
           (own.placement.num_layers, own.workload.batch, own.workload.prompt_len, own.workload.output_len, own.workload.objective)
    assert p.provenance.architecture_hash == spec.architecture_hash() and p.placement.cpu_units == own.placement.cpu_units == own.placement.num_units
    shorter, _ = replan_bundle(bundle, host_hardware, prompt_len=64, output_len=32)
    assert (shorter.workload.prompt_len, shorter.workload.output_len, shorter.workload.batch) == (64, 32, own.workload.batch)
    # This bundle was built for a machine without a GPU: a plan that would put its blocks on one is refused, with
    # what to do, rather than written for code the bundle does not hold.
    laptop = load_hardware("rtx4060-laptop")
    with pytest.raises(HelmcError, match="holds no GPU stage"):
        replan_bundle(bundle, dataclasses.replace(host_hardware, gpu=laptop.gpu, link=laptop.link))
    # A machine whose CPU lacks the features the bundle's CPU code was built for cannot run it: said, not planned.
    missing = [f for f in host_hardware.cpu.features if f not in laptop.cpu.features]
    if missing:
        with pytest.raises(HelmcError, match="this CPU lacks"):
            replan_bundle(bundle, laptop)


def test_plan_cli_on_a_bundle_then_run_with_it(tiny, host_hardware, tmp_path):
    """The plan file made from a profile runs through `helmc run --plan` and gives the tokens of the bundle's own
    plan (the same split here: the CPU-only test machine); the table says which plan it chose."""
    bundle = tiny.bundle("qwen3")
    hw = tmp_path / "hardware.json"
    host_hardware.save(str(hw))
    out = tmp_path / "plan.json"
    runner = CliRunner()
    r = runner.invoke(main, ["plan", bundle, str(hw), "--output-len", "48", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "chosen:" in r.output and Plan.from_json(out.read_text()).workload.output_len == 48
    args = ["run", bundle, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "6", "--json"]
    own = json.loads(runner.invoke(main, args).output.strip().splitlines()[-1])
    r = runner.invoke(main, args + ["--plan", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["tokens"] == own["tokens"]


def test_plan_for_another_model_or_batch_is_refused(tiny, host_hardware, tmp_path):
    bundle = tiny.bundle("qwen3")
    own = Plan.from_json(open(f"{bundle}/plan.json").read())
    runner = CliRunner()
    other = tmp_path / "other.json"
    other.write_text(own.replace(architecture_hash="0" * 16).to_json())
    r = runner.invoke(main, ["run", bundle, "--prompt-ids", "1,2", "--plan", str(other)])
    assert r.exit_code != 0 and "plan made for this bundle's model" in r.output and "Traceback" not in r.output
    r = runner.invoke(main, ["run", bundle, "--prompt-ids", "1,2", "--plan", str(tmp_path / "missing.json")])
    assert r.exit_code != 0 and "expected a plan JSON file" in r.output
    hw = tmp_path / "hardware.json"
    host_hardware.save(str(hw))
    r = runner.invoke(main, ["plan", bundle, str(hw), "--batch", "4"])
    assert r.exit_code != 0 and "expected no --batch" in r.output
    assert isinstance(HardwareProfile.load(str(hw)), HardwareProfile)
