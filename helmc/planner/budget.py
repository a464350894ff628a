"""The VRAM a plan may use, decided here for every path that plans: `helmc build --gpu-budget`, `helmc plan
--gpu-budget` (a model or a bundle), calibrating and predicting a bundle's plan.

A budget given in GiB caps the profile's usable VRAM (the runtime reserve included); without one, a plan made
before (a bundle's) keeps the VRAM it was made for, since its budget is part of the bundle; else all free VRAM.
"""
from __future__ import annotations

import dataclasses

from helmc.hardware.profile import HardwareProfile, load_hardware
from helmc.runtime.bundle.plan import Plan


def budgeted(hardware: "str | HardwareProfile", gpu_budget_gib: float | None = None,
             made_for: Plan | None = None) -> HardwareProfile:
    """The profile (a HardwareProfile, a hardware.json path or a preset name) with the VRAM a plan may use:
    `gpu_budget_gib` where given (HardwareProfile.with_gpu_budget checks it), else `made_for`'s usable VRAM where
    it has one, else the profile as it is."""
    hw = load_hardware(hardware)
    if gpu_budget_gib is not None:
        return hw.with_gpu_budget(gpu_budget_gib)
    if made_for is not None and hw.gpu is not None and made_for.memory.usable_vram_bytes > 0:
        return dataclasses.replace(hw, gpu_budget_bytes=made_for.memory.usable_vram_bytes)
    return hw
