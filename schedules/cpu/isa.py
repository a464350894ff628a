"""Which x86 vector instruction set the CPU stage is compiled for, chosen from hardware.json's CPU features.

The features are /proc/cpuinfo flag names (avx2, fma, f16c, avx512f, ...). A bundle built on one machine
for another must use the *target's* instructions, so nothing here looks at the build machine.

Tiers, best first:
  avx512 -- AVX-512 F/BW/VL/DQ + FMA + F16C: 16 fp32 lanes, 32 vector registers (x86-64-v4 level).
  avx2   -- AVX2 + FMA + F16C: 8 fp32 lanes, 16 vector registers (x86-64-v3 level). The thesis's kernel.
  sse2   -- portable x86-64 baseline: correct, but fp16 loads become library calls and vectors are
            4 lanes wide; several times below DRAM bandwidth (the CPU stage then stops being memory-bound).
"""
from __future__ import annotations

from dataclasses import dataclass

# /proc/cpuinfo flag -> LLVM feature, for the extensions that change code generation beyond the tier.
_EXTRA_LLVM_FEATURES = {
    "avx512_bf16": "+avx512bf16",
    "avx512_fp16": "+avx512fp16",
    "avx512_vnni": "+avx512vnni",
    "avx_vnni": "+avxvnni",
}

_TIER_FLAGS = {
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"),
    "sse2": ("sse2",),
}

# psABI micro-architecture levels: exactly the instructions of the tier, no more, so the code runs on any
# CPU with those flags (a "haswell" or "sapphirerapids" mcpu would also switch on unrelated extensions).
_TIER_MCPU = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "sse2": "x86-64"}


@dataclass(frozen=True)
class VectorIsa:
    tier: str                       # "avx512" | "avx2" | "sse2"
    fp32_lanes: int                 # fp32 elements in one vector register
    vector_registers: int
    llvm_mcpu: str
    llvm_mattr: tuple[str, ...]
    required_flags: tuple[str, ...]  # /proc/cpuinfo flags the compiled code executes

    def __post_init__(self):
        assert self.tier in _TIER_MCPU, self.tier
        assert self.fp32_lanes in (4, 8, 16), self.fp32_lanes

    @property
    def is_slow_fallback(self) -> bool:
        return self.tier == "sse2"


def select_isa(features: tuple[str, ...] | list[str]) -> VectorIsa:
    """The best tier whose flags are all in `features`, plus the AVX-512 extensions present."""
    have = {f.lower() for f in features}
    # avx512 tier also needs the avx2 tier's scalar extensions (x86-64-v4 includes x86-64-v3).
    if set(_TIER_FLAGS["avx512"]) <= have and set(_TIER_FLAGS["avx2"]) <= have:
        extras = tuple(sorted(v for k, v in _EXTRA_LLVM_FEATURES.items() if k in have and k != "avx_vnni"))
        # LLVM's AVX-512 CPUs prefer 256-bit vectors; our kernels are pure streaming FMA loops where
        # 512-bit registers halve the instruction count, so ask for them.
        mattr = ("-prefer-256-bit",) + extras
        flags = tuple(sorted(set(_TIER_FLAGS["avx512"]) | set(_TIER_FLAGS["avx2"])
                             | {k for k in _EXTRA_LLVM_FEATURES if k in have and k != "avx_vnni"}))
        return VectorIsa("avx512", 16, 32, _TIER_MCPU["avx512"], mattr, flags)
    if set(_TIER_FLAGS["avx2"]) <= have:
        return VectorIsa("avx2", 8, 16, _TIER_MCPU["avx2"], (), tuple(sorted(_TIER_FLAGS["avx2"])))
    return VectorIsa("sse2", 4, 16, _TIER_MCPU["sse2"], (), ("sse2",))


def missing_flags(required: tuple[str, ...] | list[str], cpu_flags: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Flags a bundle needs that this CPU lacks (empty when it can run here)."""
    have = {f.lower() for f in cpu_flags}
    return tuple(f for f in required if f.lower() not in have)
