"""The VRAM budget is decided in one place (planner/budget.py) for building, planning, replanning a bundle and
predicting its plan."""
import pytest

from helmc.errors import HelmcError
from helmc.hardware.profile import GIB, load_hardware
from helmc.planner.budget import budgeted
from helmc.planner.search_partition import plan
from qwen3_configs import write_config


def test_a_given_budget_wins_then_the_plans_then_all_vram(tmp_path):
    laptop = load_hardware("rtx4060-laptop")
    made = plan(write_config(str(tmp_path / "q8"), "Qwen3-8B"), laptop, gpu_budget_gib=5)
    assert made.memory.usable_vram_bytes == 5 * GIB                       # the planner's entry applied the budget
    assert budgeted(laptop, 3, made_for=made).usable_vram_bytes == 3 * GIB
    assert budgeted(laptop, made_for=made).usable_vram_bytes == 5 * GIB
    assert budgeted("rtx4060-laptop") == laptop
    assert budgeted(laptop).usable_vram_bytes == laptop.gpu.vram_free_bytes > 5 * GIB


def test_a_profile_without_a_gpu_keeps_none_and_a_bad_budget_is_one_line(tmp_path):
    laptop = load_hardware("rtx4060-laptop")
    made = plan(write_config(str(tmp_path / "q8"), "Qwen3-8B"), laptop, gpu_budget_gib=5)
    cpu_only = laptop.__class__(**{**laptop.__dict__, "gpu": None, "link": None})
    assert budgeted(cpu_only, made_for=made).usable_vram_bytes == 0
    with pytest.raises(HelmcError, match="--gpu-budget expected a positive number of GiB, found -1"):
        budgeted(laptop, -1)
