"""Plan: the partition chosen at build time (thesis Algorithm 1) and why.

Partition units, in order: unit 0 = embedding, units 1..L = transformer blocks 0..L-1, unit L+1 =
final norm + lm_head. A plan puts the first `cpu_units` units on the CPU and the rest on the GPU;
the token loop reads these numbers and makes no placement decision of its own.

Invariants (checked on construction, the only way to make one): 0 <= cpu_units <= num_units;
t_plan = t_cpu + t_gpu + t_comm; when candidates are present there is one per split k = 0..num_units,
in order, the chosen one is feasible and no feasible candidate is faster.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.jsonio import from_dict, parse_json, to_dict

PLAN_FORMAT_VERSION = 1
_TIME_TOLERANCE_MS = 1e-6


@dataclass(frozen=True)
class Candidate:
    cpu_units: int
    gpu_units: int
    t_cpu_ms: float
    t_gpu_ms: float                  # includes t_overhead_ms
    t_comm_ms: float
    t_plan_ms: float
    gpu_bytes: int                   # all the split needs in VRAM (weights, KV, workspace, reserve)
    cpu_bytes: int                   # all it needs in host RAM
    feasible: bool
    why: str = ""
    t_overhead_ms: float = 0.0       # GPU stage's blocks x delta (thesis 6.4.4) + sigma if it holds the head; part of t_gpu_ms
    max_context: int = 0

    def __post_init__(self):
        if abs(self.t_cpu_ms + self.t_gpu_ms + self.t_comm_ms - self.t_plan_ms) > 1e-6 * max(1.0, self.t_plan_ms):
            raise HelmcError(f"candidate k={self.cpu_units}: t_plan_ms expected t_cpu + t_gpu + t_comm = "
                             f"{self.t_cpu_ms + self.t_gpu_ms + self.t_comm_ms}, found {self.t_plan_ms}")


@dataclass(frozen=True)
class Plan:
    format_version: int
    num_layers: int
    cpu_units: int
    t_cpu_ms: float = 0.0
    t_gpu_ms: float = 0.0
    t_comm_ms: float = 0.0
    t_plan_ms: float = 0.0
    cpu_bytes: int = 0
    gpu_bytes: int = 0
    max_context: int = 0             # the longest prompt + output the plan allows
    objective: str = "decode"
    prompt_len: int = 128
    output_len: int = 128
    batch: int = 1
    candidates: tuple[Candidate, ...] = ()
    kv_offload: bool = True
    cpu_weight_bytes: int = 0
    gpu_weight_bytes: int = 0
    usable_vram_bytes: int = 0
    ram_free_bytes: int = 0
    hardware_hash: str = ""
    architecture_hash: str = ""
    fallbacks: tuple[str, ...] = ()  # cost-model fallbacks used for unmeasured hardware figures
    prefill_on_gpu: bool = False     # CPU blocks' prefill runs on the GPU, weights streamed block by block
    prefill_chunk_tokens: int = 0    # the GPU runs a prompt this many tokens at a time (0: all at once)
    prefill_staging_bytes: int = 0   # VRAM holding the streamed CPU block's weights during prefill
    gpu_kv_pool_bytes: int = 0       # VRAM left for GPU-layer KV pages after weights, workspace, reserve

    def __post_init__(self):
        if self.format_version != PLAN_FORMAT_VERSION:
            raise HelmcError(f"plan: format_version expected {PLAN_FORMAT_VERSION}, found {self.format_version}")
        if not 0 <= self.cpu_units <= self.num_units:
            raise HelmcError(f"plan: cpu_units expected 0..{self.num_units}, found {self.cpu_units}")
        if abs(self.t_cpu_ms + self.t_gpu_ms + self.t_comm_ms - self.t_plan_ms) > 1e-6 * max(1.0, self.t_plan_ms):
            raise HelmcError(f"plan: t_plan_ms expected t_cpu + t_gpu + t_comm, found {self.t_plan_ms}")
        if self.candidates:
            ks = [c.cpu_units for c in self.candidates]
            if ks != list(range(self.num_units + 1)):
                raise HelmcError(f"plan: candidates expected for k = 0..{self.num_units} in order, found {ks}")
            chosen = self.candidates[self.cpu_units]
            if not chosen.feasible:
                raise HelmcError(f"plan: the chosen split k={self.cpu_units} is marked infeasible")
            best = min(c.t_plan_ms for c in self.candidates if c.feasible)
            if chosen.t_plan_ms > best + _TIME_TOLERANCE_MS:
                raise HelmcError(f"plan: the chosen split takes {chosen.t_plan_ms:.3f} ms, a feasible one {best:.3f} ms")
        if self.prefill_on_gpu and not (len(self.cpu_layers) and self.uses_gpu and self.prefill_staging_bytes > 0):
            raise HelmcError("plan: prefill_on_gpu expected only with CPU blocks, a GPU stage and VRAM to stage a "
                             f"block, found {len(self.cpu_layers)} CPU blocks, staging {self.prefill_staging_bytes} B")
        if min(self.prefill_chunk_tokens, self.prefill_staging_bytes, self.gpu_kv_pool_bytes) < 0:
            raise HelmcError("plan: prefill_chunk_tokens, prefill_staging_bytes and gpu_kv_pool_bytes expected >= 0")

    @property
    def num_units(self) -> int:
        return self.num_layers + 2

    @property
    def gpu_units(self) -> int:
        return self.num_units - self.cpu_units

    @property
    def embed_on_gpu(self) -> bool:
        return self.cpu_units == 0

    @property
    def head_on_gpu(self) -> bool:
        return self.cpu_units < self.num_units

    @property
    def cpu_layers(self) -> range:
        """Transformer blocks on the CPU: unit i (1..L) is block i-1."""
        return range(0, max(0, min(self.cpu_units - 1, self.num_layers)))

    @property
    def gpu_layers(self) -> range:
        return range(len(self.cpu_layers), self.num_layers)

    @property
    def uses_gpu(self) -> bool:
        return self.gpu_units > 0

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.batch / self.t_plan_ms if self.t_plan_ms > 0 else 0.0

    def describe(self) -> str:
        return describe_split(self.cpu_units, self.num_units)

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return from_dict(cls, parse_json(text, "plan"), "plan")


def describe_split(cpu_units: int, num_units: int) -> str:
    """The thesis's notation: cpu(k) -> cuda(n - k)."""
    if cpu_units >= num_units:
        return f"cpu({cpu_units})"
    if cpu_units == 0:
        return f"cuda({num_units})"
    return f"cpu({cpu_units}) -> cuda({num_units - cpu_units})"


def all_cpu_plan(num_layers: int, max_context: int) -> Plan:
    return Plan(format_version=PLAN_FORMAT_VERSION, num_layers=num_layers, cpu_units=num_layers + 2,
                max_context=max_context)
