"""Which x86 vector instruction set the CPU stage is compiled for, chosen from hardware.json's CPU features.

The features are /proc/cpuinfo flag names (avx2, fma, f16c, avx512f, ...). A bundle built on one machine
for another must use the *target's* instructions, so nothing here looks at the build machine.

Tiers, best first:
  avx512 -- AVX-512 F/BW/VL/DQ + AVX2 + FMA + F16C: 16 fp32 lanes, 32 vector registers. With amx_tile and
            amx_bf16 also listed, bf16 prefill GEMMs run on AMX tiles (gemm_amx.py).
  avx2   -- AVX2 + FMA + F16C: 8 fp32 lanes, 16 vector registers. The thesis's kernel.
  sse2   -- portable x86-64 baseline: correct, but fp16 is decoded with integer arithmetic and vectors are
            4 lanes wide; measured 0.9 GB/s (fp16) and 2.6 GB/s (bf16) on 2 cores, far below DRAM bandwidth
            (the CPU stage then stops being memory-bound).
"""
from __future__ import annotations

from dataclasses import dataclass

# /proc/cpuinfo flag -> LLVM feature. Code is compiled for the generic x86-64 CPU plus exactly the features of
# this table that the target lists (never a named CPU such as "sapphirerapids", which would switch on
# extensions the profile did not report), and the flags used are what the bundle then requires.
_LLVM_FEATURE = {
    "avx": "+avx", "avx2": "+avx2", "fma": "+fma", "f16c": "+f16c",
    "bmi1": "+bmi", "bmi2": "+bmi2", "abm": "+lzcnt", "movbe": "+movbe",
    "avx512f": "+avx512f", "avx512bw": "+avx512bw", "avx512vl": "+avx512vl", "avx512dq": "+avx512dq",
    "avx512cd": "+avx512cd", "avx512_bf16": "+avx512bf16", "avx512_fp16": "+avx512fp16",
    "avx512_vnni": "+avx512vnni", "amx_tile": "+amx-tile", "amx_bf16": "+amx-bf16",
}
# What each tier cannot do without; the other flags of its group are used when present.
_TIER_NEEDS = {
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma", "f16c"),
}
_TIER_USES = {
    "avx512": tuple(_LLVM_FEATURE),
    "avx2": ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"),
    "sse2": (),
}


@dataclass(frozen=True)
class VectorIsa:
    tier: str                       # "avx512" | "avx2" | "sse2"
    fp32_lanes: int                 # fp32 elements in one vector register
    vector_registers: int
    llvm_mcpu: str
    llvm_mattr: tuple[str, ...]
    required_flags: tuple[str, ...]  # /proc/cpuinfo flags the compiled code may execute

    def __post_init__(self):
        assert self.tier in _TIER_USES, self.tier
        assert self.fp32_lanes in (4, 8, 16), self.fp32_lanes

    @property
    def is_slow_fallback(self) -> bool:
        return self.tier == "sse2"

    @property
    def has_amx_bf16(self) -> bool:
        """AMX tiles with bf16 dot products (Sapphire Rapids+): the prefill GEMM of bf16 weights uses them."""
        return {"amx_tile", "amx_bf16"} <= set(self.required_flags)


def select_isa(features: tuple[str, ...] | list[str]) -> VectorIsa:
    """The best tier whose essential flags are all in `features`, using every other flag of it present."""
    have = {f.lower() for f in features}
    for tier, lanes, registers in (("avx512", 16, 32), ("avx2", 8, 16)):
        if set(_TIER_NEEDS[tier]) <= have:
            used = tuple(sorted(f for f in _TIER_USES[tier] if f in have))
            mattr = tuple(_LLVM_FEATURE[f] for f in used)
            if tier == "avx512":
                # Generic x86-64 tuning already prefers full-width vectors; say so explicitly, because for
                # these streaming FMA loops 512-bit registers halve the instruction count.
                mattr += ("-prefer-256-bit",)
                if "avx512_vnni" in used:
                    # A tuning flag, not an instruction set: without it LLVM splits vpdpwssd into vpmaddwd +
                    # vpaddd for the generic CPU (quant/gemv_int8.py's inner step; Ice Lake and later, Zen 4 run
                    # it as one instruction).
                    mattr += ("+fast-dpwssd",)
            return VectorIsa(tier, lanes, registers, "x86-64", mattr, used)
    return VectorIsa("sse2", 4, 16, "x86-64", (), ())


def missing_flags(required: tuple[str, ...] | list[str], cpu_flags: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Flags a bundle needs that this CPU lacks (empty when it can run here)."""
    have = {f.lower() for f in cpu_flags}
    return tuple(f for f in required if f.lower() not in have)
