"""Plan: the partition chosen at build time (thesis Algorithm 1) and why, made of one part a job (plan_parts.py):
`placement` (the decision, all the runtime reads to place anything), `predictions` (the cost model's figures and the
candidates), `memory` (the sizes the runtime allocates by), `workload` (what it was made for) and `provenance`. Each
part checks its own invariants; Plan checks those that join two parts: when candidates are present there is one per
split k = 0..num_units, the chosen one is feasible and no feasible candidate (split or hybrid layout) is faster; a
hybrid plan's t_cpu_ms and t_copy_ms are its groups' sums and every streamed group fits the staging ring; prefill on
the GPU has VRAM to stage a block.

plan.json is the Plan's parts as JSON objects; a plan.json of format 1 (the fields flat, as helmc wrote before the
parts) is read into the parts.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.jsonio import from_dict, parse_json, to_dict
from helmc.runtime.bundle.plan_parts import (GROUP_KINDS, Candidate, HybridCandidate, MemoryBudget, Placement,
                                             PlanGroup, PlanWorkload, Predictions, Provenance, describe_split)

__all__ = ["GROUP_KINDS", "PAIR_TIE_SHARE", "PLAN_FORMAT_VERSION", "Candidate", "HybridCandidate", "MemoryBudget",
           "Placement", "Plan", "PlanGroup", "PlanWorkload", "Predictions", "Provenance", "all_cpu_plan",
           "describe_split", "read_plan_file"]

PLAN_FORMAT_VERSION = 2
_FLAT_FORMAT_VERSION = 1           # every field at the top level; read into the parts
_TIME_TOLERANCE_MS = 1e-6
# Among hybrid layouts within this share of the fastest prediction, a plan for several sequences takes the one with
# the fewest pairs: what the executor spends per pair beyond its two crossings is not in the cost model
# (planner/hybrid.py).
PAIR_TIE_SHARE = 0.02
# Each part's fields; a field's name is unique across the parts (Plan.of and Plan.replace route by it).
PARTS = {"placement": Placement, "predictions": Predictions, "memory": MemoryBudget, "workload": PlanWorkload,
         "provenance": Provenance}
_PART_OF = {f.name: part for part, cls in PARTS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class Plan:
    placement: Placement
    predictions: Predictions = Predictions()
    memory: MemoryBudget = MemoryBudget()
    workload: PlanWorkload = PlanWorkload()
    provenance: Provenance = Provenance()
    format_version: int = PLAN_FORMAT_VERSION

    def __post_init__(self):
        if self.format_version != PLAN_FORMAT_VERSION:
            raise HelmcError(f"plan: format_version expected {PLAN_FORMAT_VERSION}, found {self.format_version}")
        for part, cls in PARTS.items():
            if not isinstance(getattr(self, part), cls):
                raise HelmcError(f"plan: {part} expected a {cls.__name__}, found {type(getattr(self, part)).__name__}")
        pl, pr, mem = self.placement, self.predictions, self.memory
        self._check_hybrid()
        if pr.candidates:
            if len(pr.candidates) != pl.num_units + 1:
                raise HelmcError(f"plan: candidates expected for k = 0..{pl.num_units}, found "
                                 f"{len(pr.candidates)} of them")
            chosen = self._chosen_row()
            if not chosen.feasible:
                raise HelmcError(f"plan: the chosen {self.describe()} is marked infeasible")
            best = min(c.t_plan_ms for c in pr.candidates + pr.hybrid_candidates if c.feasible)
            # A hybrid layout may give up PAIR_TIE_SHARE of its prediction for fewer pairs (planner/hybrid.py).
            tie = PAIR_TIE_SHARE if pl.groups and self.workload.batch > 1 else 0
            if chosen.t_plan_ms > best * (1 + tie) + _TIME_TOLERANCE_MS:
                raise HelmcError(f"plan: the chosen {self.describe()} takes {chosen.t_plan_ms:.3f} ms, a feasible "
                                 f"one {best:.3f} ms")
        if pl.prefill_on_gpu and mem.prefill_staging_bytes <= 0:
            raise HelmcError(f"plan: prefill_on_gpu expected VRAM to stage a block, found prefill_staging_bytes "
                             f"{mem.prefill_staging_bytes}")

    def _check_hybrid(self) -> None:
        pl, pr, mem = self.placement, self.predictions, self.memory
        if not pl.groups:
            if mem.staging_ring_bytes or pr.t_copy_ms:
                raise HelmcError("plan: staging_ring_bytes and t_copy_ms expected 0 without streamed groups, found "
                                 f"{mem.staging_ring_bytes}, {pr.t_copy_ms}")
            return
        over = [g.first_layer for g in pl.groups if g.kind == "streamed" and g.weight_bytes > mem.staging_ring_bytes]
        if over or mem.staging_ring_bytes <= 0:
            raise HelmcError(f"plan: streamed groups expected to fit the staging ring of {mem.staging_ring_bytes} B, "
                             f"found groups at blocks {over} larger")
        for name, total, found in (("t_cpu_ms", sum(g.t_overlap_ms for g in pl.groups), pr.t_cpu_ms),
                                   ("t_copy_ms", sum(g.t_copy_ms for g in pl.groups), pr.t_copy_ms)):
            if abs(total - found) > 1e-6 * max(1.0, found):
                raise HelmcError(f"plan: {name} of a hybrid plan expected the groups' sum {total}, found {found}")

    def _chosen_row(self) -> "Candidate | HybridCandidate":
        pl, pr = self.placement, self.predictions
        if not pl.groups:
            return pr.candidates[pl.cpu_units]
        key = (pl.cpu_units, len(pl.groups) // 2, len(pl.streamed_layers))
        row = next((c for c in pr.hybrid_candidates if c.key() == key), None)
        if row is None:
            raise HelmcError(f"plan: the chosen hybrid layout {key} expected among hybrid_candidates, found "
                             f"{[c.key() for c in pr.hybrid_candidates]}")
        return row

    @classmethod
    def of(cls, **fields) -> "Plan":
        """A Plan of its parts' fields given flat (num_layers=, cpu_units=, t_plan_ms=, max_context=, ...), each
        routed to the part it belongs to; format_version as the constructor's."""
        parts = _split_fields(fields, "plan")
        return cls(**{part: PARTS[part](**kw) for part, kw in parts.items() if part in PARTS},
                   **parts.get("", {}))

    def replace(self, **fields) -> "Plan":
        """This plan with some of its parts' fields changed (named flat, as Plan.of), checked again whole."""
        parts = _split_fields(fields, "plan.replace")
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **kw)
                                            for part, kw in parts.items() if part in PARTS}, **parts.get("", {}))

    @property
    def tokens_per_s(self) -> float:
        """The predicted rate: the batch's tokens per predicted step."""
        t = self.predictions.t_plan_ms
        return 1e3 * self.workload.batch / t if t > 0 else 0.0

    def describe(self) -> str:
        return self.placement.describe()

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = parse_json(text, "plan")
        if isinstance(d, dict) and d.get("format_version") == _FLAT_FORMAT_VERSION:
            d = _nested(d)
        elif isinstance(d, dict) and d.get("format_version") != PLAN_FORMAT_VERSION:
            raise HelmcError(f"plan: format_version expected {PLAN_FORMAT_VERSION} (or {_FLAT_FORMAT_VERSION}, read "
                             f"into the parts), found {d.get('format_version')!r}; make the plan again (helmc plan)")
        return from_dict(cls, d, "plan")


def _split_fields(fields: dict, what: str) -> dict[str, dict]:
    parts: dict[str, dict] = {}
    for name, value in fields.items():
        part = "" if name == "format_version" else _PART_OF.get(name)
        if part is None:
            raise HelmcError(f"{what}: expected fields of {', '.join(PARTS)}, found {name!r}")
        parts.setdefault(part, {})[name] = value
    parts.setdefault("placement", {})
    return parts


def _nested(flat: dict) -> dict:
    """A format-1 plan.json (the parts' fields at the top level) as the parts; an unknown key is refused."""
    out: dict = {"format_version": PLAN_FORMAT_VERSION}
    for name, value in flat.items():
        if name == "format_version":
            continue
        part = _PART_OF.get(name)
        if part is None:
            raise HelmcError(f"plan: unknown key {name!r} in a plan of format {_FLAT_FORMAT_VERSION}")
        out.setdefault(part, {})[name] = value
    return out


def all_cpu_plan(num_layers: int, max_context: int) -> Plan:
    return Plan(Placement(num_layers=num_layers, cpu_units=num_layers + 2),
                memory=MemoryBudget(max_context=max_context))


def read_plan_file(path: str) -> Plan:
    """A Plan JSON written by `helmc plan ... -o FILE`, for `helmc run|serve|chat --plan FILE` (a regular file of at
    most 64 MiB: a FIFO or device is refused before it is opened)."""
    import os

    from helmc.jsonio import read_regular_file
    if not os.path.exists(path):
        raise HelmcError(f"--plan: expected a plan JSON file (helmc plan BUNDLE hardware.json -o FILE), found nothing "
                         f"at {path}")
    data = read_regular_file(path, "--plan", limit=64 << 20)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise HelmcError(f"--plan: expected a plan JSON file (helmc plan BUNDLE hardware.json -o FILE), found "
                         f"bytes that are not UTF-8 in {path}") from None
    return Plan.from_json(text)
