"""Plan: the partition chosen at build time (thesis Algorithm 1) and why.

Partition units, in order: unit 0 = embedding, units 1..L = transformer blocks 0..L-1, unit L+1 =
final norm + lm_head. A plan puts the first `cpu_units` units on the CPU and the rest on the GPU;
the token loop reads these numbers and makes no placement decision of its own.

Hybrid decode: `groups` orders the host-resident blocks (cpu_layers) into CPU groups and streamed
groups, alternating, CPU first: the CPU computes a CPU group while the weights of the streamed group after it are
copied over PCIe into a staging ring of `staging_ring_bytes` in VRAM (the copy of streamed group i is issued when
CPU group i starts), then the GPU computes that streamed group from the ring; the GPU-resident blocks and the head
follow the last streamed group. Prefill is unchanged (the CPU blocks' prefill streams to the GPU as before). A
plan without groups is the plain split, and serializes without the hybrid keys, exactly as before them.

Invariants (checked on construction, the only way to make one): 0 <= cpu_units <= num_units;
t_plan = t_cpu + t_gpu + t_comm; when candidates are present there is one per split k = 0..num_units,
in order, the chosen one is feasible and no feasible candidate (split or hybrid layout) is faster; groups
alternate, CPU first, cover cpu_layers in order, and every streamed group fits the ring.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.jsonio import from_dict, parse_json, to_dict

PLAN_FORMAT_VERSION = 1
_TIME_TOLERANCE_MS = 1e-6
# Among hybrid layouts within this share of the fastest prediction, a plan for several sequences takes the one with
# the fewest pairs: what the executor spends per pair beyond its two crossings is not in the cost model
# (planner/hybrid.py).
PAIR_TIE_SHARE = 0.02


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


GROUP_KINDS = ("cpu", "streamed")
# Keys a plan without streamed groups leaves out of its JSON, so it reads exactly as a plan made without hybrid decode.
_HYBRID_KEYS = ("groups", "staging_ring_bytes", "t_copy_ms", "hybrid_candidates")


@dataclass(frozen=True)
class PlanGroup:
    """A run of host-resident blocks in hybrid decode's order, with its predicted times per token."""
    kind: str                        # "cpu": the CPU computes it; "streamed": copied to the ring, the GPU computes it
    first_layer: int
    num_layers: int
    weight_bytes: int = 0            # its blocks' weights as stored (streamed: bytes copied per token)
    t_compute_ms: float = 0.0        # cpu: on the CPU alone; streamed: on the GPU from the ring
    t_copy_ms: float = 0.0           # streamed: its copy over PCIe alone
    t_overlap_ms: float = 0.0        # streamed: its copy and the CPU group before it, run together (DRAM shared)

    def __post_init__(self):
        if self.kind not in GROUP_KINDS:
            raise HelmcError(f"plan group: kind expected one of {GROUP_KINDS}, found {self.kind!r}")
        if self.first_layer < 0 or self.num_layers < 1 or self.weight_bytes < 0:
            raise HelmcError(f"plan group: expected first_layer >= 0, num_layers >= 1, weight_bytes >= 0, found "
                             f"{self.first_layer}, {self.num_layers}, {self.weight_bytes}")
        if self.kind == "cpu" and (self.t_copy_ms or self.t_overlap_ms):
            raise HelmcError("plan group: a cpu group expected no copy or overlap time, found some")

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclass(frozen=True)
class HybridCandidate:
    """One hybrid layout the search scored: `pairs` (CPU group, streamed group) pairs over the host-resident
    units [0, cpu_units), `streamed_blocks` of them streamed, the ring holding the largest streamed group."""
    cpu_units: int
    pairs: int
    streamed_blocks: int
    ring_bytes: int
    t_cpu_ms: float                  # the CPU groups with their copies running (the overlapped phases)
    t_gpu_ms: float                  # streamed groups and the GPU-resident stage
    t_comm_ms: float                 # every crossing: activations both ways between the pairs, the token ids back
    t_plan_ms: float
    gpu_bytes: int
    cpu_bytes: int
    feasible: bool
    why: str = ""
    t_copy_ms: float = 0.0           # the streamed groups' copies alone, summed (hidden in t_cpu_ms where they overlap)
    max_context: int = 0

    def __post_init__(self):
        if abs(self.t_cpu_ms + self.t_gpu_ms + self.t_comm_ms - self.t_plan_ms) > 1e-6 * max(1.0, self.t_plan_ms):
            raise HelmcError(f"hybrid candidate k={self.cpu_units}, {self.pairs} pairs: t_plan_ms expected "
                             f"t_cpu + t_gpu + t_comm, found {self.t_plan_ms}")
        if self.pairs < 1 or self.streamed_blocks < self.pairs or self.ring_bytes <= 0:
            raise HelmcError(f"hybrid candidate: expected pairs >= 1, streamed_blocks >= pairs and ring_bytes > 0, "
                             f"found {self.pairs}, {self.streamed_blocks}, {self.ring_bytes}")

    def key(self) -> tuple[int, int, int]:
        return (self.cpu_units, self.pairs, self.streamed_blocks)


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
    expert_staging_bytes: int = 0    # VRAM holding host experts' weights streamed for a prompt (runtime/moe_prefill)
    gpu_kv_pool_bytes: int = 0       # VRAM left for GPU-layer KV pages after weights, workspace, reserve
    # Hybrid decode (see the module docstring); all empty / 0 for a plain split.
    groups: tuple[PlanGroup, ...] = ()
    staging_ring_bytes: int = 0
    t_copy_ms: float = 0.0           # the streamed groups' copies alone, summed (overlapped inside t_cpu_ms)
    hybrid_candidates: tuple[HybridCandidate, ...] = ()   # the best layout per pair count
    # Mixture of experts: per block (index = block), the routed experts whose weights live in VRAM, sorted; the
    # block's other experts run on the CPU from host RAM. Empty: every routed expert in host RAM (a dense model,
    # or a MoE model whose experts all stay on the CPU).
    gpu_experts: tuple[tuple[int, ...], ...] = ()
    # The predicted share of a token's selected experts found in VRAM (from the bundle's routing statistics where it
    # has them, else uniform routing); 0 without gpu_experts, and then left out of the JSON.
    expert_hit_rate: float = 0.0

    def __post_init__(self):
        if self.format_version != PLAN_FORMAT_VERSION:
            raise HelmcError(f"plan: format_version expected {PLAN_FORMAT_VERSION}, found {self.format_version}")
        if not 0 <= self.cpu_units <= self.num_units:
            raise HelmcError(f"plan: cpu_units expected 0..{self.num_units}, found {self.cpu_units}")
        if abs(self.t_cpu_ms + self.t_gpu_ms + self.t_comm_ms - self.t_plan_ms) > 1e-6 * max(1.0, self.t_plan_ms):
            raise HelmcError(f"plan: t_plan_ms expected t_cpu + t_gpu + t_comm, found {self.t_plan_ms}")
        self._check_groups()
        if self.candidates:
            ks = [c.cpu_units for c in self.candidates]
            if ks != list(range(self.num_units + 1)):
                raise HelmcError(f"plan: candidates expected for k = 0..{self.num_units} in order, found {ks}")
            chosen = self._chosen_row()
            if not chosen.feasible:
                raise HelmcError(f"plan: the chosen {self.describe()} is marked infeasible")
            best = min(c.t_plan_ms for c in self.candidates + self.hybrid_candidates if c.feasible)
            # A hybrid layout may give up PAIR_TIE_SHARE of its prediction for fewer pairs (planner/hybrid.py).
            if chosen.t_plan_ms > best * (1 + (PAIR_TIE_SHARE if self.groups and self.batch > 1 else 0)) \
                    + _TIME_TOLERANCE_MS:
                raise HelmcError(f"plan: the chosen {self.describe()} takes {chosen.t_plan_ms:.3f} ms, a feasible "
                                 f"one {best:.3f} ms")
        if self.prefill_on_gpu and not (len(self.cpu_layers) and self.uses_gpu and self.prefill_staging_bytes > 0):
            raise HelmcError("plan: prefill_on_gpu expected only with CPU blocks, a GPU stage and VRAM to stage a "
                             f"block, found {len(self.cpu_layers)} CPU blocks, staging {self.prefill_staging_bytes} B")
        if min(self.prefill_chunk_tokens, self.prefill_staging_bytes, self.gpu_kv_pool_bytes,
               self.expert_staging_bytes) < 0:
            raise HelmcError("plan: prefill_chunk_tokens, prefill_staging_bytes, expert_staging_bytes and "
                             "gpu_kv_pool_bytes expected >= 0")
        self._check_gpu_experts()

    def _check_gpu_experts(self) -> None:
        if not 0.0 <= self.expert_hit_rate <= 1.0:
            raise HelmcError(f"plan: expert_hit_rate expected in [0, 1], found {self.expert_hit_rate}")
        if not self.gpu_experts:
            return
        if len(self.gpu_experts) != self.num_layers:
            raise HelmcError(f"plan: gpu_experts expected one entry per block ({self.num_layers}), found "
                             f"{len(self.gpu_experts)}")
        for i, ids in enumerate(self.gpu_experts):
            if list(ids) != sorted(set(ids)) or any(not isinstance(e, int) or e < 0 for e in ids):
                raise HelmcError(f"plan: gpu_experts of block {i} expected increasing expert indices, found "
                                 f"{str(ids)[:80]}")

    def _check_groups(self) -> None:
        if not self.groups:
            if self.staging_ring_bytes or self.t_copy_ms:
                raise HelmcError("plan: staging_ring_bytes and t_copy_ms expected 0 without streamed groups, found "
                                 f"{self.staging_ring_bytes}, {self.t_copy_ms}")
            return
        kinds = [g.kind for g in self.groups]
        want = [GROUP_KINDS[i % 2] for i in range(len(kinds))]
        if kinds != want or kinds[-1] != "streamed":
            raise HelmcError(f"plan: groups expected to alternate cpu, streamed, ..., ending with a streamed group, "
                             f"found {kinds}")
        if not (1 <= self.cpu_units <= self.num_layers + 1):
            raise HelmcError(f"plan: hybrid decode expected the embedding on the CPU and the head on the GPU "
                             f"(cpu_units 1..{self.num_layers + 1}), found cpu_units {self.cpu_units}")
        at = 0
        for g in self.groups:
            if g.first_layer != at:
                raise HelmcError(f"plan: {g.kind} group expected to start at block {at}, found {g.first_layer}")
            at += g.num_layers
        if at != len(self.cpu_layers):
            raise HelmcError(f"plan: groups expected to cover the {len(self.cpu_layers)} host-resident blocks, found "
                             f"{at}")
        over = [g.first_layer for g in self.groups if g.kind == "streamed" and g.weight_bytes > self.staging_ring_bytes]
        if over or self.staging_ring_bytes <= 0:
            raise HelmcError(f"plan: streamed groups expected to fit the staging ring of {self.staging_ring_bytes} B, "
                             f"found groups at blocks {over} larger")
        for name, total, found in (("t_cpu_ms", sum(g.t_overlap_ms for g in self.groups), self.t_cpu_ms),
                                   ("t_copy_ms", sum(g.t_copy_ms for g in self.groups), self.t_copy_ms)):
            if abs(total - found) > 1e-6 * max(1.0, found):
                raise HelmcError(f"plan: {name} of a hybrid plan expected the groups' sum {total}, found {found}")

    def _chosen_row(self) -> "Candidate | HybridCandidate":
        if not self.groups:
            return self.candidates[self.cpu_units]
        key = (self.cpu_units, len(self.groups) // 2, len(self.streamed_layers))
        row = next((c for c in self.hybrid_candidates if c.key() == key), None)
        if row is None:
            raise HelmcError(f"plan: the chosen hybrid layout {key} expected among hybrid_candidates, found "
                             f"{[c.key() for c in self.hybrid_candidates]}")
        return row

    @property
    def num_units(self) -> int:
        return self.num_layers + 2

    @property
    def is_hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        """Host-resident blocks the GPU computes in decode, their weights copied over PCIe each token."""
        return tuple(i for g in self.groups if g.kind == "streamed" for i in g.layers)

    @property
    def cpu_compute_layers(self) -> tuple[int, ...]:
        """Blocks the CPU computes in decode: the host-resident ones that are not streamed."""
        streamed = set(self.streamed_layers)
        return tuple(i for i in self.cpu_layers if i not in streamed)

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
        """Host-resident transformer blocks (unit i (1..L) is block i-1): the CPU computes all of them in a plain
        split; in hybrid decode it computes cpu_compute_layers and the GPU the streamed_layers."""
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
        split = describe_split(self.cpu_units, self.num_units)
        if not self.groups:
            return split
        return f"{split}, hybrid decode: {len(self.groups) // 2} x (cpu + streamed), {len(self.streamed_layers)} blocks streamed"

    def to_json(self) -> str:
        d = to_dict(self)
        if not self.groups:
            for key in _HYBRID_KEYS:
                if d[key] in ([], 0, 0.0):
                    del d[key]
        if not self.gpu_experts:
            del d["gpu_experts"], d["expert_hit_rate"]
        return json.dumps(d, indent=2, sort_keys=True)

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
