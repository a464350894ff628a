"""The profile's GPU reserve (planner/measure_reserve.py): what a runtime process holds beyond its plan's allocations,
plus a margin. The measurement itself needs a GPU (tests/hardware/test_profile_hardware.py::test_real_gpu_profile);
here: its arithmetic, and that a profile without a GPU or without a kit GPU stage keeps its reserve and says why."""
import dataclasses

import pytest

from helmc.errors import HelmcError
from helmc.planner.measure_reserve import MARGIN_BYTES, ReserveMeasurement, profile_gpu_reserve, reserve_with_margin
from helmc.hardware.profile import load_hardware

MIB = 1 << 20


def test_overhead_is_the_larger_of_the_context_and_what_the_process_held_beyond_its_plan():
    m = ReserveMeasurement(peak_used_bytes=3000 * MIB, planned_bytes=2470 * MIB, context_bytes=400 * MIB)
    assert m.beyond_plan_bytes == 530 * MIB and m.overhead_bytes == 530 * MIB
    assert m.reserve_bytes == 530 * MIB + MARGIN_BYTES        # 10% of it (53 MiB) is under the margin's floor
    assert reserve_with_margin(2000 * MIB) == 2200 * MIB       # above the floor: 10%
    # the kit's plan counting more than it allocates : the context alone is the larger figure
    kit = ReserveMeasurement(peak_used_bytes=3754 * MIB, planned_bytes=3411 * MIB, context_bytes=529 * MIB)
    assert kit.beyond_plan_bytes == 343 * MIB and kit.overhead_bytes == 529 * MIB
    assert kit.reserve_bytes == 529 * MIB + MARGIN_BYTES
    assert ReserveMeasurement(peak_used_bytes=100, planned_bytes=200).overhead_bytes == 0
    assert "above its plan" in m.note() and "context" in m.note()
    with pytest.raises(HelmcError, match="planned > 0"):
        ReserveMeasurement(peak_used_bytes=1, planned_bytes=0)
    with pytest.raises(HelmcError, match="context >= 0"):
        ReserveMeasurement(peak_used_bytes=1, planned_bytes=1, context_bytes=-1)


def test_no_gpu_keeps_the_reserve():
    hw = load_hardware("h100-sxm-measured")
    cpu_only = dataclasses.replace(hw, gpu=None, link=None)
    assert profile_gpu_reserve(cpu_only, "/nonexistent") is cpu_only


def test_a_kit_without_a_gpu_stage_for_this_arch_is_said(tmp_path):
    from helmc.hardware.kit import KIT_FORMAT_VERSION, BlockShape, ProfileKit
    hw = load_hardware("h100-sxm-measured")
    ProfileKit(format_version=KIT_FORMAT_VERSION, isa="avx2", required_flags=(), l3_bytes=1 << 25, cores=16,
               block=BlockShape(), read_elements=1, l3_read_elements=1, read_name="r", l3_read_name="l", kernels=(),
               gemm_name="g").save(str(tmp_path))                     # a CPU-only kit
    out = profile_gpu_reserve(hw, str(tmp_path))
    assert out.gpu_reserve_bytes == hw.gpu_reserve_bytes
    assert any(u.startswith("gpu_reserve_bytes: the kit has no GPU stage") for u in out.unmeasured)


def test_a_child_that_cannot_run_is_a_clear_error(tmp_path):
    """The real child process, on a machine where it cannot bring a GPU up (no CuPy here, or no bundle): the error
    names what was expected and the child's last line; nothing is left running. (With a GPU the same call measures:
    tests/hardware/test_profile_hardware.py::test_real_gpu_profile.)"""
    from helmc.planner.measure_reserve import measure_gpu_reserve
    hw = load_hardware("h100-sxm-measured")
    with pytest.raises(HelmcError, match="expected the kit's GPU stage to run a request in a fresh process") as e:
        measure_gpu_reserve(hw, str(tmp_path / "no-bundle"), str(tmp_path), used=lambda: 0)
    print(f"\n{e.value}")
    assert "Error" in str(e.value)            # the child's own last line (an import or a missing bundle)
