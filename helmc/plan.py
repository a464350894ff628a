"""Plan: the partition chosen at build time (thesis Algorithm 1) and why.

Partition units, in order: unit 0 = embedding, units 1..L = transformer blocks 0..L-1, unit L+1 =
final norm + lm_head. A plan puts the first `cpu_units` units on the CPU and the rest on the GPU;
the token loop reads these numbers and makes no placement decision of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import HelmcError
from .jsonio import from_dict, to_dict

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Candidate:
    cpu_units: int
    gpu_units: int
    t_cpu_ms: float
    t_gpu_ms: float
    t_comm_ms: float
    t_plan_ms: float
    gpu_bytes: int
    cpu_bytes: int
    feasible: bool
    why: str = ""


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

    def __post_init__(self):
        if self.format_version != PLAN_FORMAT_VERSION:
            raise HelmcError(f"plan: format_version expected {PLAN_FORMAT_VERSION}, found {self.format_version}")
        if not 0 <= self.cpu_units <= self.num_units:
            raise HelmcError(f"plan: cpu_units expected 0..{self.num_units}, found {self.cpu_units}")

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

    def describe(self) -> str:
        if not self.uses_gpu:
            return f"cpu({self.cpu_units})"
        if self.cpu_units == 0:
            return f"cuda({self.gpu_units})"
        return f"cpu({self.cpu_units}) -> cuda({self.gpu_units})"

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return from_dict(cls, json.loads(text), "plan")


def all_cpu_plan(num_layers: int, max_context: int) -> Plan:
    return Plan(format_version=PLAN_FORMAT_VERSION, num_layers=num_layers, cpu_units=num_layers + 2,
                max_context=max_context)
