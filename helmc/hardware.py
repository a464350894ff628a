"""HardwareProfile: the measured target (thesis 4.1.2, eq. 4.6): device profiles and the link.

Written by `helmc profile`, or taken from a preset under artifacts/profiles/. Every figure is a
measurement or a cited datasheet number; what could not be measured is listed in `unmeasured`
rather than invented. Unknown keys are refused so a typo never silently changes a plan.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .errors import HelmcError
from .jsonio import atomic_write_text, from_dict, load_json_file, to_dict

PROFILE_FORMAT_VERSION = 1
GIB = 1024 ** 3


@dataclass(frozen=True)
class CpuProfile:
    name: str
    cores: int
    features: tuple[str, ...]        # /proc/cpuinfo flag names: avx2, f16c, fma, avx512f, avx512_bf16, ...
    l3_bytes: int
    dram_gbs: float                  # M: sustained read bandwidth over a buffer >> L3
    ram_total_bytes: int
    ram_free_bytes: int
    dram_strided_gbs: float = 0.0    # inference-like pattern (many row streams); 0 = not measured
    l3_gbs: float = 0.0              # B_L3; 0 = not measured (cost model then uses 3 x M, as the thesis)
    fp32_gflops: float = 0.0         # P_dec on the CPU; 0 = not measured (thesis sets P_dec = M)

    def has(self, *flags: str) -> bool:
        return all(f in self.features for f in flags)


@dataclass(frozen=True)
class GpuProfile:
    name: str
    arch: str                        # CUDA arch, e.g. "sm_90"
    vram_total_bytes: int
    vram_free_bytes: int
    hbm_gbs: float                   # M on the GPU
    fp16_tflops: float = 0.0         # P_pre: (128,H)x(H,H) fp16 matmul rate; 0 = not measured


@dataclass(frozen=True)
class LinkProfile:
    h2d_gbs: float                   # B_link, pinned host -> device
    d2h_gbs: float
    latency_us: float                # l_link: small-transfer round trip with sync


@dataclass(frozen=True)
class HardwareProfile:
    format_version: int
    cpu: CpuProfile
    gpu: GpuProfile | None = None
    link: LinkProfile | None = None
    gpu_budget_bytes: int = 0        # 0: no cap; else the plan may use at most this much VRAM
    block_overhead_ms: float = 0.0   # delta of thesis 6.4.4, per block per token, calibrated where a GPU is present
    source: str = "measured"         # "measured" or "preset:<name>"
    unmeasured: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.format_version != PROFILE_FORMAT_VERSION:
            raise HelmcError(f"hardware profile: format_version expected {PROFILE_FORMAT_VERSION}, found {self.format_version}")
        if (self.gpu is None) != (self.link is None):
            raise HelmcError("hardware profile: gpu and link must be both present or both absent")

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def usable_vram_bytes(self) -> int:
        if self.gpu is None:
            return 0
        free = self.gpu.vram_free_bytes
        return min(free, self.gpu_budget_bytes) if self.gpu_budget_bytes else free

    def with_gpu_budget(self, gib: float | None) -> "HardwareProfile":
        import dataclasses
        if gib is None:
            return self
        if gib <= 0:
            raise HelmcError(f"--gpu-budget expected a positive number of GiB, found {gib}")
        return dataclasses.replace(self, gpu_budget_bytes=int(gib * GIB))

    def profile_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return from_dict(cls, json.loads(text), "hardware profile")

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        return from_dict(cls, load_json_file(path, "hardware profile"), f"hardware profile {path}")

    def save(self, path: str) -> None:
        atomic_write_text(path, self.to_json() + "\n")
