"""The parts a Plan (plan.py) is made of, one a job, each checking its own invariants when made:

- Placement: the decision the runtime acts on, and all it reads to place anything: which partition units run on
  the CPU, hybrid decode's groups, which routed experts live in VRAM, how prefill runs.
- Predictions: what the cost model predicts for that placement, and every candidate it was chosen among.
- MemoryBudget: what the placement needs and may use in host RAM and VRAM: the sizes the runtime allocates by.
- PlanWorkload: what the plan was made for (objective, prompt and output lengths, sequences at once, KV offload).
- Provenance: the hardware profile and model architecture it was made from.

Partition units, in order: unit 0 = embedding, units 1..L = transformer blocks 0..L-1, unit L+1 =
final norm + lm_head. A placement puts the first `cpu_units` units on the CPU and the rest on the GPU.

Hybrid decode: `groups` orders the host-resident blocks (cpu_layers) into CPU groups and streamed groups,
alternating, CPU first: the CPU computes a CPU group while the weights of the streamed group after it are copied over
PCIe into a staging ring in VRAM (the copy of streamed group i is issued when CPU group i starts), then the GPU
computes that streamed group from the ring; the GPU-resident blocks and the head follow the last streamed group.
A placement without groups is the plain split.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from helmc.errors import HelmcError

GROUP_KINDS = ("cpu", "streamed")
OBJECTIVES = ("decode", "prefill")


def _sum_holds(t_cpu: float, t_gpu: float, t_comm: float, t_plan: float) -> bool:
    return abs(t_cpu + t_gpu + t_comm - t_plan) <= 1e-6 * max(1.0, t_plan)


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
        if not _sum_holds(self.t_cpu_ms, self.t_gpu_ms, self.t_comm_ms, self.t_plan_ms):
            raise HelmcError(f"candidate k={self.cpu_units}: t_plan_ms expected t_cpu + t_gpu + t_comm = "
                             f"{self.t_cpu_ms + self.t_gpu_ms + self.t_comm_ms}, found {self.t_plan_ms}")


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
        if not _sum_holds(self.t_cpu_ms, self.t_gpu_ms, self.t_comm_ms, self.t_plan_ms):
            raise HelmcError(f"hybrid candidate k={self.cpu_units}, {self.pairs} pairs: t_plan_ms expected "
                             f"t_cpu + t_gpu + t_comm, found {self.t_plan_ms}")
        if self.pairs < 1 or self.streamed_blocks < self.pairs or self.ring_bytes <= 0:
            raise HelmcError(f"hybrid candidate: expected pairs >= 1, streamed_blocks >= pairs and ring_bytes > 0, "
                             f"found {self.pairs}, {self.streamed_blocks}, {self.ring_bytes}")

    def key(self) -> tuple[int, int, int]:
        return (self.cpu_units, self.pairs, self.streamed_blocks)


@dataclass(frozen=True)
class Placement:
    """Where each part of the model runs. Invariants: 0 <= cpu_units <= num_units; groups alternate, CPU first, end
    with a streamed group and cover cpu_layers in order, with the embedding on the CPU and the head on the GPU;
    gpu_experts has one sorted entry per block (or none); prefill on the GPU only with CPU blocks and a GPU stage."""
    num_layers: int
    cpu_units: int
    groups: tuple[PlanGroup, ...] = ()   # hybrid decode (see the module docstring); empty for a plain split
    # Mixture of experts: per block (index = block), the routed experts whose weights live in VRAM, sorted; the
    # block's other experts run on the CPU from host RAM. Empty: every routed expert in host RAM (a dense model,
    # or a MoE model whose experts all stay on the CPU).
    gpu_experts: tuple[tuple[int, ...], ...] = ()
    # a block's VRAM slots (as many as its gpu_experts) refreshed at run time from the experts its tokens select
    # (runtime/moe_expert_cache.py); off: the slots keep gpu_experts
    expert_cache: bool = False
    prefill_on_gpu: bool = False     # CPU blocks' prefill runs on the GPU, weights streamed block by block
    prefill_chunk_tokens: int = 0    # the GPU runs a prompt this many tokens at a time (0: all at once)

    def __post_init__(self):
        if self.num_layers < 0 or not 0 <= self.cpu_units <= self.num_units:
            raise HelmcError(f"plan placement: cpu_units expected 0..{self.num_units}, found {self.cpu_units}")
        if self.prefill_chunk_tokens < 0:
            raise HelmcError(f"plan placement: prefill_chunk_tokens expected >= 0, found {self.prefill_chunk_tokens}")
        self._check_groups()
        self._check_gpu_experts()
        if self.prefill_on_gpu and not (len(self.cpu_layers) and self.uses_gpu):
            raise HelmcError("plan placement: prefill_on_gpu expected only with CPU blocks and a GPU stage, found "
                             f"{len(self.cpu_layers)} CPU blocks, {self.gpu_units} GPU units")

    def _check_groups(self) -> None:
        if not self.groups:
            return
        kinds = [g.kind for g in self.groups]
        want = [GROUP_KINDS[i % 2] for i in range(len(kinds))]
        if kinds != want or kinds[-1] != "streamed":
            raise HelmcError(f"plan placement: groups expected to alternate cpu, streamed, ..., ending with a "
                             f"streamed group, found {kinds}")
        if not (1 <= self.cpu_units <= self.num_layers + 1):
            raise HelmcError(f"plan placement: hybrid decode expected the embedding on the CPU and the head on the "
                             f"GPU (cpu_units 1..{self.num_layers + 1}), found cpu_units {self.cpu_units}")
        at = 0
        for g in self.groups:
            if g.first_layer != at:
                raise HelmcError(f"plan placement: {g.kind} group expected to start at block {at}, found "
                                 f"{g.first_layer}")
            at += g.num_layers
        if at != len(self.cpu_layers):
            raise HelmcError(f"plan placement: groups expected to cover the {len(self.cpu_layers)} host-resident "
                             f"blocks, found {at}")

    def _check_gpu_experts(self) -> None:
        if not self.gpu_experts:
            return
        if len(self.gpu_experts) != self.num_layers:
            raise HelmcError(f"plan placement: gpu_experts expected one entry per block ({self.num_layers}), found "
                             f"{len(self.gpu_experts)}")
        for i, ids in enumerate(self.gpu_experts):
            if list(ids) != sorted(set(ids)) or any(not isinstance(e, int) or e < 0 for e in ids):
                raise HelmcError(f"plan placement: gpu_experts of block {i} expected increasing expert indices, "
                                 f"found {str(ids)[:80]}")

    @property
    def num_units(self) -> int:
        return self.num_layers + 2

    @property
    def gpu_units(self) -> int:
        return self.num_units - self.cpu_units

    @property
    def is_hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def embed_on_gpu(self) -> bool:
        return self.cpu_units == 0

    @property
    def head_on_gpu(self) -> bool:
        return self.cpu_units < self.num_units

    @property
    def uses_gpu(self) -> bool:
        return self.gpu_units > 0

    @property
    def cpu_layers(self) -> range:
        """Host-resident transformer blocks (unit i (1..L) is block i-1): the CPU computes all of them in a plain
        split; in hybrid decode it computes cpu_compute_layers and the GPU the streamed_layers."""
        return range(0, max(0, min(self.cpu_units - 1, self.num_layers)))

    @property
    def gpu_layers(self) -> range:
        return range(len(self.cpu_layers), self.num_layers)

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        """Host-resident blocks the GPU computes in decode, their weights copied over PCIe each token."""
        return tuple(i for g in self.groups if g.kind == "streamed" for i in g.layers)

    @property
    def cpu_compute_layers(self) -> tuple[int, ...]:
        """Blocks the CPU computes in decode: the host-resident ones that are not streamed."""
        streamed = set(self.streamed_layers)
        return tuple(i for i in self.cpu_layers if i not in streamed)

    def describe(self) -> str:
        split = describe_split(self.cpu_units, self.num_units)
        if not self.groups:
            return split
        return (f"{split}, hybrid decode: {len(self.groups) // 2} x (cpu + streamed), {len(self.streamed_layers)} "
                f"blocks streamed")


@dataclass(frozen=True)
class Predictions:
    """The cost model's figures for the placement, per token (decode) or to the first token (prefill), and the
    candidates it was chosen among. Invariants: t_plan_ms = t_cpu_ms + t_gpu_ms + t_comm_ms; candidates, when
    present, one per split k = 0, 1, ... in order."""
    t_cpu_ms: float = 0.0
    t_gpu_ms: float = 0.0
    t_comm_ms: float = 0.0
    t_plan_ms: float = 0.0
    t_copy_ms: float = 0.0           # hybrid: the streamed groups' copies alone, summed (overlapped inside t_cpu_ms)
    candidates: tuple[Candidate, ...] = ()
    hybrid_candidates: tuple[HybridCandidate, ...] = ()   # the best hybrid layout per pair count
    fallbacks: tuple[str, ...] = ()  # cost-model fallbacks used for unmeasured hardware figures
    # The predicted share of a token's selected experts found in VRAM (from the bundle's routing statistics where it
    # has them, else uniform routing); 0 without experts in VRAM.
    expert_hit_rate: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.expert_hit_rate <= 1.0:
            raise HelmcError(f"plan predictions: expert_hit_rate expected 0..1, found {self.expert_hit_rate}")
        if not _sum_holds(self.t_cpu_ms, self.t_gpu_ms, self.t_comm_ms, self.t_plan_ms):
            raise HelmcError(f"plan predictions: t_plan_ms expected t_cpu + t_gpu + t_comm, found {self.t_plan_ms}")
        if self.t_copy_ms < 0:
            raise HelmcError(f"plan predictions: t_copy_ms expected >= 0, found {self.t_copy_ms}")
        ks = [c.cpu_units for c in self.candidates]
        if ks != list(range(len(ks))):
            raise HelmcError(f"plan predictions: candidates expected for k = 0, 1, ... in order, found {ks}")


@dataclass(frozen=True)
class MemoryBudget:
    """What the placement needs and may use, in bytes, and the longest sequence that fits. Invariant: every size
    >= 0."""
    max_context: int = 0             # the longest prompt + output the plan allows
    cpu_bytes: int = 0               # all the placement needs in host RAM
    gpu_bytes: int = 0               # all it needs in VRAM (weights, KV, workspace, reserve)
    cpu_weight_bytes: int = 0
    gpu_weight_bytes: int = 0
    usable_vram_bytes: int = 0       # the profile's VRAM (after the budget)
    ram_free_bytes: int = 0          # the profile's free host RAM
    gpu_kv_pool_bytes: int = 0       # VRAM left for GPU-layer KV pages after weights, workspace, reserve
    prefill_staging_bytes: int = 0   # VRAM holding the streamed CPU block's weights during prefill
    staging_ring_bytes: int = 0      # hybrid decode: VRAM the streamed groups are copied into
    expert_staging_bytes: int = 0    # VRAM holding host experts' weights streamed for a prompt (runtime/moe_prefill)

    def __post_init__(self):
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise HelmcError(f"plan memory: {', '.join(negative)} expected >= 0, found "
                             f"{', '.join(str(getattr(self, n)) for n in negative)}")


@dataclass(frozen=True)
class PlanWorkload:
    """What the plan was made for. Invariants: objective one of OBJECTIVES, batch >= 1, lengths >= 0."""
    objective: str = "decode"        # "decode" (ms per token) or "prefill" (ms to the first token)
    prompt_len: int = 128
    output_len: int = 128
    batch: int = 1                   # sequences decoded at once
    kv_offload: bool = True          # KV of GPU blocks may go to pinned host pages

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise HelmcError(f"plan workload: objective expected one of {OBJECTIVES}, found {self.objective!r}")
        if self.batch < 1 or self.prompt_len < 0 or self.output_len < 0:
            raise HelmcError(f"plan workload: expected batch >= 1, prompt_len >= 0, output_len >= 0, found "
                             f"{self.batch}, {self.prompt_len}, {self.output_len}")


@dataclass(frozen=True)
class Provenance:
    """What the plan was made from: the hardware profile's and the model architecture's hashes ("" unknown)."""
    hardware_hash: str = ""
    architecture_hash: str = ""

    def __post_init__(self):
        if not isinstance(self.hardware_hash, str) or not isinstance(self.architecture_hash, str):
            raise HelmcError("plan provenance: hardware_hash and architecture_hash expected strings, found "
                             f"{type(self.hardware_hash).__name__}, {type(self.architecture_hash).__name__}")


def describe_split(cpu_units: int, num_units: int) -> str:
    """The thesis's notation: cpu(k) -> cuda(n - k)."""
    if cpu_units >= num_units:
        return f"cpu({cpu_units})"
    if cpu_units == 0:
        return f"cuda({num_units})"
    return f"cpu({cpu_units}) -> cuda({num_units - cpu_units})"
