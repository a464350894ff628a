"""HardwareProfile: the measured target (thesis 4.1.2, eq. 4.6): device profiles and the link.

Written by `helmc profile`, or taken from a preset in helmc/hardware/presets/. Every figure is a
measurement or a cited datasheet number; what could not be measured is listed in `unmeasured`
("field: reason") rather than invented, and the cost model says which fallback it used for it.
Unknown keys are refused so a typo never silently changes a plan.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from helmc.errors import HelmcError
from helmc.jsonio import atomic_write_text, from_dict, load_json_file, parse_json, to_dict

# 2: the CPU's read rates come from helmc's own compiled kernels (host_read_gbs, gemv_reads replace numpy's
# dram_strided_gbs) and the link carries the DRAM + PCIe rates measured at once (what hybrid decode is planned on).
PROFILE_FORMAT_VERSION = 2
GIB = 1024 ** 3
# Thesis 4.1.3: "after reserving ~1 GB for the CUDA context and runtime"; the thesis's units are
# decimal (its 386 MB block is 385.9e6 bytes), so 1e9 bytes. Kept per profile because the context
# size depends on the GPU and driver.
DEFAULT_GPU_RESERVE_BYTES = 10 ** 9
# The host runtime itself (Python, TVM runtime, tokenizer) needs memory beside weights and KV.
DEFAULT_HOST_RESERVE_BYTES = GIB
PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HelmcError(f"hardware profile: {message}")


# Bounds on what a profile may say, far outside any real machine but inside what the planner's arithmetic and the
# allocations it sizes can take: a figure past them is a corrupt or hand-edited file, refused when it is read.
MAX_GBS = 1e5                    # bytes/s of any memory or link, in GB/s (HBM3e: ~5e3)
MAX_FLOPS = 1e7                  # GFLOP/s or TFLOP/s
MAX_BYTES = 1 << 50              # any memory size (1 PiB)
MAX_COUNT = 1 << 16              # cores, threads, rows
MAX_OVERHEAD_MS = 1e3            # |delta| or |sigma| per block or token
MAX_LATENCY_US = 1e6


def _bound_of(name: str) -> "tuple[float, float] | None":
    if name.endswith("overhead_ms"):
        return -MAX_OVERHEAD_MS, MAX_OVERHEAD_MS
    if name.endswith("_ms"):
        return 0.0, MAX_OVERHEAD_MS
    if name.endswith("_gbs"):
        return 0.0, MAX_GBS
    if name.endswith(("_gflops", "_tflops")):
        return 0.0, MAX_FLOPS
    if name.endswith("_bytes"):
        return 0, MAX_BYTES
    if name.endswith("_us"):
        return 0.0, MAX_LATENCY_US
    if name in ("cores", "threads", "rows"):
        return 0, MAX_COUNT
    return None


def _check_numbers(where: str, obj) -> None:
    """Every number of a profile part finite and within _bound_of its name."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        bound = _bound_of(f.name)
        _require(math.isfinite(v) and (bound is None or bound[0] <= v <= bound[1]),
                 f"{where}.{f.name} expected a finite number" + (f" in [{bound[0]:g}, {bound[1]:g}]" if bound else "")
                 + f", found {v}")


def _check_overheads(where: str, block_overhead_ms: Optional[float], step_overhead_ms: Optional[float]) -> None:
    # Calibrated deltas may be negative: a device that beats the roofline of the profile's rates (e.g. a profile
    # measured on another machine) gets a delta that brings the roofline down to it; the cost model never lets a
    # stage's time fall below 0 (cost_model.StageTime), and _check_numbers bounds them.
    for name, value in (("block_overhead_ms", block_overhead_ms), ("step_overhead_ms", step_overhead_ms)):
        _require(value is None or math.isfinite(value),
                 f"{where}.{name} expected a finite number or null (not calibrated), found {value}")


def _check_eta(where: str, eta_compute: float, eta_memory: float) -> None:
    _require(0 < eta_compute <= 1 and 0 < eta_memory <= 1,
             f"{where} efficiency coefficients expected in (0, 1], found eta_compute={eta_compute}, "
             f"eta_memory={eta_memory}")


@dataclass(frozen=True)
class KernelRead:
    """What one of helmc's decode GEMVs reads from DRAM on every core: weights of one type (a float dtype or a
    QUANT_BLOCKS key) in the shapes of a transformer block, cycled over more than the L3 holds."""
    weight_type: str                 # a float dtype (float16, ...) or a weight_types block format
    gbs: float
    rows: int = 1                    # decode rows per call (a batched step of that many sequences reads each weight once)

    def __post_init__(self):
        _require(bool(self.weight_type) and self.gbs > 0 and self.rows >= 1,
                 f"cpu.gemv_reads expected a weight type, gbs > 0 and rows >= 1, found {self.weight_type!r}, "
                 f"{self.gbs}, {self.rows}")
        _check_numbers("gemv_reads", self)


@dataclass(frozen=True)
class ExpertSumRead:
    """What the CPU library's one-call expert sum of a mixture of experts (schedules/cpu/quant/moe_experts.py) reads
    per second over a model's stacked host experts, at `experts` selected experts per call (the experts' gate/up type
    names the kernel). Measured by `helmc calibrate` on a mixture-of-experts bundle (runtime/moe_expert_rate.py)."""
    weight_type: str
    experts: int
    gbs: float

    def __post_init__(self):
        _require(bool(self.weight_type) and self.gbs > 0 and 1 <= self.experts <= MAX_COUNT,
                 f"cpu.expert_sum_reads expected a weight type, experts >= 1 and gbs > 0, found {self.weight_type!r}, "
                 f"{self.experts}, {self.gbs}")
        _check_numbers("expert_sum_reads", self)


@dataclass(frozen=True)
class CpuProfile:
    name: str
    cores: int                       # physical cores this process may run on
    features: tuple[str, ...]        # /proc/cpuinfo flag names: avx2, f16c, fma, avx512f, avx512_bf16, ...
    l3_bytes: int                    # C_L3, summed over the L3 instances this process may use
    dram_gbs: float                  # sustained read over one buffer >> L3, every core (helmc's stream-read kernel)
    ram_total_bytes: int
    ram_free_bytes: int
    # M of the cost model: what helmc's CPU stage reads, its fp16 decode GEMVs (fused q/k/v, o, SwiGLU, down) on
    # every core over block-shaped weights >> L3. 0 = not measured (the cost model then uses dram_gbs).
    host_read_gbs: float = 0.0
    gemv_reads: tuple[KernelRead, ...] = ()   # the same per weight type (quantized models' M)
    l3_gbs: float = 0.0              # B_L3; 0 = not measured (cost model then uses 3 x M, as the thesis)
    # KV bytes/s helmc's compiled decode-attention kernel reads over a context >> L3 (a layer's KV does not stay in
    # the L3 between tokens: every block's weights stream through it). 0 = not measured (eq. 4.14's blend of M
    # and B_L3; the kernel measured ~0.74 M on the GPU machine's Xeon, where the blend expects 1.17 M)
    attention_read_gbs: float = 0.0
    fp32_gflops: float = 0.0         # P_dec on the CPU; 0 = not measured (thesis sets P_dec = M)
    threads: int = 0                 # hardware threads this process may run on; 0 = not known
    eta_compute: float = 1.0         # eta_c of eq. 4.10; 1: the measured rates are already sustained rates
    eta_memory: float = 1.0          # eta_m of eq. 4.10
    # Thesis 6.4.4 deltas of helmc's own CPU stage: `helmc profile` on a synthetic block, `helmc calibrate` on a
    # bundle (None: not measured).
    block_overhead_ms: Optional[float] = None   # per block per token beyond its roofline; None: the profile-wide figure
    step_overhead_ms: Optional[float] = None    # per token beyond the lm_head's roofline when the head runs here
                                                # (embedding gather, RoPE tables, head, logits out, sampling); None: 0
    # What helmc's CPU stage reads of its blocks' weights per second, everything in a decode step counted (the
    # GEMVs, the norms between them, KV append and attention, the Python between kernels): `helmc profile`'s
    # synthetic fp16 blocks through the compiled stage, bytes / time. The figure to hold a real stage's read
    # against (bench_decode's profile_dram_vs_measured); M with the block overhead is how the cost model splits
    # the same time. 0 = not measured.
    stage_read_gbs: float = 0.0
    # The weight bytes of the blocks block_overhead_ms was fitted on, per block: the cost model charges a block of b
    # bytes delta * b / overhead_block_bytes (0 = unknown: delta whole per block). Measured on an H100 host, the
    # overhead a real split's CPU stage implies per block: fp16 8B blocks 0.89 x the fp16-fitted delta, Q4_K 8B
    # blocks (0.28 of the bytes) 0.40 x, Q4_K 14B (0.48 of the bytes) 0.21 x; charged whole, the Q4_K splits were
    # planned 29-32% slow.
    overhead_block_bytes: int = 0
    # A mixture of experts' one-call expert sum per experts' type and selected count (ExpertSumRead); empty: not
    # measured (the cost model then prices the CPU's experts at the GEMV rate, named in Plan.predictions.fallbacks).
    expert_sum_reads: tuple[ExpertSumRead, ...] = ()

    def __post_init__(self):
        _require(self.cores > 0, f"cpu.cores expected > 0, found {self.cores}")
        _require(self.dram_gbs > 0, f"cpu.dram_gbs expected > 0, found {self.dram_gbs}")
        _require(self.ram_total_bytes > 0 and 0 < self.ram_free_bytes <= self.ram_total_bytes,
                 f"cpu.ram_free_bytes expected in (0, ram_total_bytes={self.ram_total_bytes}], found {self.ram_free_bytes}")
        _require(min(self.l3_bytes, self.host_read_gbs, self.l3_gbs, self.fp32_gflops, self.threads,
                     self.attention_read_gbs, self.stage_read_gbs, self.overhead_block_bytes) >= 0,
                 "cpu figures expected >= 0 (0 = not measured)")
        types = [(r.weight_type, r.rows) for r in self.gemv_reads]
        _require(len(set(types)) == len(types),
                 f"cpu.gemv_reads expected one entry per weight type and row count, found {types}")
        sums = [(r.weight_type, r.experts) for r in self.expert_sum_reads]
        _require(len(set(sums)) == len(sums),
                 f"cpu.expert_sum_reads expected one entry per weight type and expert count, found {sums}")
        _check_eta("cpu", self.eta_compute, self.eta_memory)
        _check_overheads("cpu", self.block_overhead_ms, self.step_overhead_ms)
        _check_numbers("cpu", self)

    def has(self, *flags: str) -> bool:
        return all(f in self.features for f in flags)

    @property
    def stream_gbs(self) -> float:
        """M used by the cost model: what helmc's GEMVs read where measured (thesis 7.1: one contiguous
        read overestimates what a block's separate weight matrices get), else the plain read."""
        return self.host_read_gbs if self.host_read_gbs > 0 else self.dram_gbs

    def read_gbs(self, weight_type: str, rows: int = 1) -> float:
        """M for weights of one type read by a decode step of `rows` sequences: the one-row GEMV's measured rate
        (else stream_gbs), and no more than a measured m-row rate scaled as compute, M_m * m / rows (a GEMV that
        turned compute-bound at m rows does rows / m times its work at `rows`). Where m-row rates were not
        measured, rows changes nothing (the cost model's fp32 compute term is all there is)."""
        one = next((r.gbs for r in self.gemv_reads if r.weight_type == weight_type and r.rows == 1), self.stream_gbs)
        if rows <= 1:
            return one
        return min([one] + [r.gbs * r.rows / rows for r in self.gemv_reads
                            if r.weight_type == weight_type and r.rows > 1])

    def expert_sum_gbs(self, weight_type: str, experts: float) -> float:
        """The one-call expert sum's read rate for experts of `weight_type` at `experts` selected per call: linear
        between the measured counts, the nearest one's outside them; 0 where none was measured for the type."""
        pts = sorted((r.experts, r.gbs) for r in self.expert_sum_reads if r.weight_type == weight_type)
        if not pts:
            return 0.0
        if experts <= pts[0][0]:
            return pts[0][1]
        for (n0, g0), (n1, g1) in zip(pts, pts[1:]):
            if experts <= n1:
                return g0 + (g1 - g0) * (experts - n0) / (n1 - n0)
        return pts[-1][1]


@dataclass(frozen=True)
class GpuProfile:
    name: str
    arch: str                        # CUDA arch, e.g. "sm_90"
    vram_total_bytes: int
    vram_free_bytes: int             # free as seen by a process that holds a CUDA context
    hbm_gbs: float                   # M on the GPU
    fp16_tflops: float = 0.0         # P_pre: (128,H)x(H,H) fp16 matmul rate; 0 = not measured
    eta_compute: float = 1.0
    eta_memory: float = 1.0
    # As on CpuProfile, for helmc's GPU stage; the GPU's step overhead also holds the hidden state's
    # and RoPE rows' host-to-device copies as the runtime makes them, beyond the link model of eq. 4.15.
    block_overhead_ms: Optional[float] = None
    step_overhead_ms: Optional[float] = None
    # helmc's own decode GEMVs, per weight type: a block's launches as the GPU stage makes them (one-launch q/k/v,
    # SwiGLU and residual epilogues), over weights in HBM (measure_gpu_gemv). Empty: every type at hbm_gbs.
    gemv_reads: tuple[KernelRead, ...] = ()
    # A mixture of experts' routed decode block whose experts are partly on the host: the host's half between the
    # GPU's two parts (route, the VRAM experts' slots and launch, the CPU's inputs; its expert sum apart), measured
    # by `helmc calibrate` on the bundle's own decode (runtime/moe_expert_rate.measure_host_half). None: not measured.
    moe_host_half_ms: Optional[float] = None

    def __post_init__(self):
        _require(self.arch.startswith("sm_"), f"gpu.arch expected like 'sm_90', found {self.arch!r}")
        _require(0 < self.vram_free_bytes <= self.vram_total_bytes,
                 f"gpu.vram_free_bytes expected in (0, vram_total_bytes={self.vram_total_bytes}], found {self.vram_free_bytes}")
        _require(self.hbm_gbs > 0, f"gpu.hbm_gbs expected > 0, found {self.hbm_gbs}")
        _require(self.fp16_tflops >= 0, f"gpu.fp16_tflops expected >= 0, found {self.fp16_tflops}")
        _check_eta("gpu", self.eta_compute, self.eta_memory)
        _check_overheads("gpu", self.block_overhead_ms, self.step_overhead_ms)
        _require(all(r.rows == 1 for r in self.gemv_reads), "gpu.gemv_reads expected one-row (decode) figures")
        _check_numbers("gpu", self)

    def read_gbs(self, weight_type: str) -> float:
        """M on the GPU for weights of one type: helmc's decode GEMVs' measured rate, else hbm_gbs."""
        return next((r.gbs for r in self.gemv_reads if r.weight_type == weight_type), self.hbm_gbs)


@dataclass(frozen=True)
class LinkProfile:
    h2d_gbs: float                   # B_link, pinned host -> device, alone
    d2h_gbs: float
    latency_us: float                # l_link: one small (8 KB) copy including its synchronisation
    # DRAM and PCIe at once (hybrid decode): host -> device copies from pinned memory while helmc's fp16 GEMVs
    # run on every core, both rates over the same window. They share the host's memory controllers, so neither
    # alone-figure (h2d_gbs, cpu.host_read_gbs) holds while the other runs. 0 = not measured.
    h2d_concurrent_gbs: float = 0.0
    cpu_read_concurrent_gbs: float = 0.0

    def __post_init__(self):
        _require(self.h2d_gbs > 0 and self.d2h_gbs > 0 and self.latency_us >= 0,
                 f"link expected h2d_gbs > 0, d2h_gbs > 0, latency_us >= 0, found "
                 f"{self.h2d_gbs}, {self.d2h_gbs}, {self.latency_us}")
        _require((self.h2d_concurrent_gbs > 0) == (self.cpu_read_concurrent_gbs > 0)
                 and min(self.h2d_concurrent_gbs, self.cpu_read_concurrent_gbs) >= 0,
                 f"link.h2d_concurrent_gbs and link.cpu_read_concurrent_gbs expected both > 0 (measured together) "
                 f"or both 0, found {self.h2d_concurrent_gbs}, {self.cpu_read_concurrent_gbs}")
        _check_numbers("link", self)

    @property
    def has_concurrent(self) -> bool:
        return self.h2d_concurrent_gbs > 0

    @property
    def combined_gbs(self) -> float:
        """Host memory read by the CPU and the DMA engine together in the measured window (0: not measured)."""
        return self.h2d_concurrent_gbs + self.cpu_read_concurrent_gbs


@dataclass(frozen=True)
class HardwareProfile:
    format_version: int
    cpu: CpuProfile
    # Optional[...] rather than `X | None`: jsonio converts typing.Union members but not types.UnionType.
    gpu: Optional[GpuProfile] = None
    link: Optional[LinkProfile] = None
    gpu_budget_bytes: int = 0        # 0: no cap; else the plan may use at most this much VRAM (reserve included)
    # Delta of thesis 6.4.4 for every device without one of its own (cpu/gpu.block_overhead_ms, which `helmc
    # profile` measures on helmc's compiled stages): a preset's thesis figure, or 0.
    block_overhead_ms: float = 0.0
    gpu_reserve_bytes: int = DEFAULT_GPU_RESERVE_BYTES    # VRAM kept back for the CUDA context and runtime
    host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES  # host RAM kept back for the runtime process
    source: str = "measured"         # "measured", "preset:<name>" or "calibrated" (helmc calibrate)
    unmeasured: tuple[str, ...] = () # "field: why it was not measured"
    notes: tuple[str, ...] = ()
    # Figures implausible against others of the same run even when measured again (helmc/hardware/host_read.recheck),
    # kept as measured and said so; absent in older profiles.
    doubtful: tuple[str, ...] = ()

    def __post_init__(self):
        if self.format_version != PROFILE_FORMAT_VERSION:
            again = " (a profile of an older helmc: run `helmc profile` again)" if self.format_version < PROFILE_FORMAT_VERSION else ""
            raise HelmcError(f"hardware profile: format_version expected {PROFILE_FORMAT_VERSION}, found "
                             f"{self.format_version}{again}")
        if (self.gpu is None) != (self.link is None):
            raise HelmcError("hardware profile: gpu and link must be both present or both absent")
        _require(self.gpu_budget_bytes >= 0, f"gpu_budget_bytes expected >= 0, found {self.gpu_budget_bytes}")
        _require(self.block_overhead_ms >= 0, f"block_overhead_ms expected >= 0, found {self.block_overhead_ms}")
        _require(self.gpu_reserve_bytes >= 0 and self.host_reserve_bytes >= 0, "reserves expected >= 0")
        _check_numbers("profile", self)

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None

    def device(self, name: str) -> "CpuProfile | GpuProfile":
        """The "cpu" or "gpu" part of the profile."""
        dev = {"cpu": self.cpu, "gpu": self.gpu}.get(name)
        _require(dev is not None, f"device expected 'cpu' or a present 'gpu', found {name!r}")
        return dev

    def block_overhead_on(self, name: str) -> float:
        """Delta per block on device `name`: its calibrated figure, else the profile-wide one."""
        own = self.device(name).block_overhead_ms
        return self.block_overhead_ms if own is None else own

    def step_overhead_on(self, name: str) -> float:
        """Per-token overhead when the lm_head runs on device `name` (0 where not calibrated)."""
        own = self.device(name).step_overhead_ms
        return 0.0 if own is None else own

    @property
    def usable_vram_bytes(self) -> int:
        """VRAM a plan may use in all (weights, KV, workspace and gpu_reserve_bytes)."""
        if self.gpu is None:
            return 0
        free = self.gpu.vram_free_bytes
        return min(free, self.gpu_budget_bytes) if self.gpu_budget_bytes else free

    def with_gpu_budget(self, gib: float | None) -> "HardwareProfile":
        if gib is None:
            return self
        if gib <= 0:
            raise HelmcError(f"--gpu-budget expected a positive number of GiB, found {gib}")
        return dataclasses.replace(self, gpu_budget_bytes=int(gib * GIB))

    def profile_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        d = to_dict(self)
        if not self.cpu.expert_sum_reads:          # left out unless measured: a profile without reads as before
            del d["cpu"]["expert_sum_reads"]
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return from_dict(cls, parse_json(text, "hardware profile"), "hardware profile")

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        return from_dict(cls, load_json_file(path, "hardware profile"), f"hardware profile {path}")

    def save(self, path: str) -> None:
        atomic_write_text(path, self.to_json() + "\n")


def list_presets() -> list[str]:
    if not os.path.isdir(PRESET_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def load_hardware(path_or_preset: "str | HardwareProfile") -> HardwareProfile:
    """A hardware.json path, or the name of a preset in helmc/hardware/presets/ (e.g. rtx4060-laptop)."""
    if isinstance(path_or_preset, HardwareProfile):
        return path_or_preset
    if os.path.exists(path_or_preset):
        return HardwareProfile.load(path_or_preset)
    name = path_or_preset[len("preset:"):] if path_or_preset.startswith("preset:") else path_or_preset
    preset = os.path.join(PRESET_DIR, name + ".json")
    if os.sep not in name and os.path.exists(preset):
        return HardwareProfile.load(preset)
    raise HelmcError(f"hardware profile: expected a hardware.json path or a preset name "
                     f"({', '.join(list_presets()) or 'none installed'}), found {path_or_preset!r}")
