"""Hybrid decode's per-token schedule, as data: which blocks each device computes, where each streamed
block's weights land in the VRAM staging ring, and the order of copies, events, crossings and computes.

The plan (runtime/bundle/plan.py, `groups`) orders the host-resident blocks as pairs (C_i, S_i):

    C_0 S_0 C_1 S_1 ... C_{m-1} S_{m-1} | GPU-resident blocks, head

Per token, for each pair i in order (`HybridSchedule.ops`):

    copy i          copy stream: wait `ring_free` (the GPU's last read of the ring), copy S_i's block arenas
                    from pinned host memory into their ring slots, record `copied[i]`
    cpu i           the CPU computes C_i (the copy runs meanwhile: both read host DRAM)
    to_gpu i        the activation crosses to the GPU (compute stream)
    wait_copy i     the compute stream waits `copied[i]`
    gpu i           the GPU computes S_i with the ring slots' tensors as the blocks' parameters
    release_ring i  compute stream: record `ring_free`
    to_host i       the activation crosses back for C_{i+1} (not after the last pair: the resident part follows)

then `resident` (the GPU-resident blocks and the head, the captured decode graph where it replays) and `finish`
(commit the step in both KV caches). `begin` opens the GPU cache's step first, so every block the GPU computes
(streamed or resident) appends to the same step.

Ring slots: S_i's blocks take consecutive ARENA_ALIGN-aligned slots from offset 0 (one arena per block, the
layout runtime/prefill_stream.PinnedBlockArena gives it, so each block is one DMA); the ring is the largest
group. Slots are the same every token, so each streamed block's TVM bindings over the ring are made once.
KV: the GPU cache holds the streamed blocks first (kv index = the block's rank among streamed blocks), then the
resident blocks; the CPU cache holds the CPU groups' blocks in order.

Pure Python and frozen: checked on construction (the invariants below), tested on the CPU with exact values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from helmc.errors import HelmcError

ARENA_ALIGN = 256                       # runtime/prefill_stream.ARENA_ALIGN (checked equal in the tests)
OP_KINDS = ("begin", "copy", "cpu", "to_gpu", "wait_copy", "gpu", "release_ring", "to_host", "resident", "finish")


def aligned(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


@dataclass(frozen=True)
class RingSlot:
    """Where one streamed block's arena lives in the staging ring while its group is on the GPU."""
    layer: int
    offset: int                         # bytes from the ring's start, a multiple of ARENA_ALIGN
    nbytes: int                         # the block's arena (its weights as the compiled functions take them)

    def __post_init__(self):
        if self.layer < 0 or self.offset < 0 or self.offset % ARENA_ALIGN or self.nbytes < 1:
            raise HelmcError(f"ring slot: expected layer >= 0, an offset that is a multiple of {ARENA_ALIGN} and "
                             f"nbytes >= 1, found {self}")

    @property
    def end(self) -> int:
        return self.offset + aligned(self.nbytes)


@dataclass(frozen=True)
class Pair:
    """C_i and S_i: the CPU group's blocks (and their CPU-cache indices), the streamed group's ring slots (and the
    GPU-cache index of its first block)."""
    index: int
    cpu_layers: tuple[int, ...]
    cpu_kv_base: int                    # KV index of cpu_layers[0] in the CPU cache
    slots: tuple[RingSlot, ...]
    gpu_kv_base: int                    # KV index of slots[0].layer in the GPU cache

    def __post_init__(self):
        if not self.cpu_layers or not self.slots:
            raise HelmcError(f"pair {self.index}: expected at least one CPU block and one streamed block")
        layers = self.cpu_layers + self.streamed_layers
        if list(layers) != list(range(layers[0], layers[0] + len(layers))):
            raise HelmcError(f"pair {self.index}: expected consecutive blocks, CPU first, found {layers}")
        at = 0
        for s in self.slots:
            if s.offset != at:
                raise HelmcError(f"pair {self.index}: slot of block {s.layer} expected at offset {at}, found {s.offset}")
            at = s.end

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.slots)

    @property
    def ring_end(self) -> int:
        return self.slots[-1].end

    @property
    def copy_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


@dataclass(frozen=True)
class Op:
    kind: str
    pair: int = -1                      # the pair it belongs to; -1 for begin, resident, finish

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise HelmcError(f"hybrid op: kind expected one of {OP_KINDS}, found {self.kind!r}")


@dataclass(frozen=True)
class HybridSchedule:
    pairs: tuple[Pair, ...]
    resident_layers: tuple[int, ...]    # GPU-resident blocks, after every pair
    ring_bytes: int
    ops: tuple[Op, ...]

    def __post_init__(self):
        if not self.pairs:
            raise HelmcError("hybrid schedule: expected at least one (CPU group, streamed group) pair")
        at, cpu_kv, gpu_kv = 0, 0, 0
        for i, p in enumerate(self.pairs):
            if p.index != i or p.cpu_layers[0] != at or p.cpu_kv_base != cpu_kv or p.gpu_kv_base != gpu_kv:
                raise HelmcError(f"hybrid schedule: pair {i} expected to start at block {at} with KV bases "
                                 f"({cpu_kv}, {gpu_kv}), found {p}")
            at += len(p.cpu_layers) + len(p.slots)
            cpu_kv += len(p.cpu_layers)
            gpu_kv += len(p.slots)
        if self.resident_layers and list(self.resident_layers) != list(range(at, at + len(self.resident_layers))):
            raise HelmcError(f"hybrid schedule: resident blocks expected to follow block {at - 1}, found "
                             f"{self.resident_layers}")
        if self.ring_bytes != max(p.ring_end for p in self.pairs):
            raise HelmcError(f"hybrid schedule: ring_bytes expected the largest group's slots, "
                             f"{max(p.ring_end for p in self.pairs)}, found {self.ring_bytes}")
        check_ops(self.ops, len(self.pairs))

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(i for p in self.pairs for i in p.streamed_layers)

    @property
    def cpu_layers(self) -> tuple[int, ...]:
        return tuple(i for p in self.pairs for i in p.cpu_layers)

    @property
    def gpu_kv_layers(self) -> tuple[int, ...]:
        """The GPU cache's blocks in its index order: streamed, then resident."""
        return self.streamed_layers + self.resident_layers

    @property
    def crossings(self) -> int:
        return sum(op.kind in ("to_gpu", "to_host") for op in self.ops)

    def describe(self) -> str:
        groups = " ".join(f"C{p.index}{_span(p.cpu_layers)} S{p.index}{_span(p.streamed_layers)}" for p in self.pairs)
        tail = f" | resident {_span(self.resident_layers)}" if self.resident_layers else " | no resident blocks"
        return f"{groups}{tail}, ring {self.ring_bytes / 2**20:.1f} MiB"


def _span(layers: tuple[int, ...]) -> str:
    return f"[{layers[0]}..{layers[-1]}]" if len(layers) > 1 else f"[{layers[0]}]"


def token_ops(num_pairs: int) -> tuple[Op, ...]:
    """The per-token order (see the module docstring)."""
    ops = [Op("begin")]
    for i in range(num_pairs):
        ops += [Op("copy", i), Op("cpu", i), Op("to_gpu", i), Op("wait_copy", i), Op("gpu", i), Op("release_ring", i)]
        if i + 1 < num_pairs:
            ops.append(Op("to_host", i))
    return tuple(ops + [Op("resident"), Op("finish")])


def check_ops(ops: tuple[Op, ...], num_pairs: int) -> None:
    """What any correct order keeps: the GPU reads a group only after its copy's event, a copy overwrites the ring
    only after the previous group's last read, the activation crosses before each streamed group and back between
    them (2m - 1 crossings), the CPU computes C_i only with the activation on the host, each op once per pair."""
    def fail(why):
        raise HelmcError(f"hybrid schedule ops: {why}: {[(o.kind, o.pair) for o in ops]}")

    seen = {}
    for n, op in enumerate(ops):
        if (op.kind, op.pair) in seen:
            fail(f"{op.kind} {op.pair} twice")
        seen[(op.kind, op.pair)] = n
    per_pair = ("copy", "cpu", "to_gpu", "wait_copy", "gpu", "release_ring")
    want = {(k, i) for i in range(num_pairs) for k in per_pair} | {("to_host", i) for i in range(num_pairs - 1)}
    want |= {("begin", -1), ("resident", -1), ("finish", -1)}
    if set(seen) != want:
        fail(f"expected exactly {sorted(want)}")
    at = lambda k, i=-1: seen[(k, i)]                                                    # noqa: E731
    if not (at("begin") == 0 and at("finish") == len(ops) - 1 and at("resident") == len(ops) - 2):
        fail("expected begin first, resident then finish last")
    for i in range(num_pairs):
        if not at("copy", i) < at("wait_copy", i) < at("gpu", i) < at("release_ring", i):
            fail(f"pair {i}: expected copy < wait_copy < gpu < release_ring")
        if not at("cpu", i) < at("to_gpu", i) < at("gpu", i):
            fail(f"pair {i}: expected the CPU group, then the crossing, before the streamed group")
        if i and not at("release_ring", i - 1) < at("copy", i):
            fail(f"pair {i}: its copy overwrites the ring before pair {i - 1}'s last read")
        if i and not at("gpu", i - 1) < at("to_host", i - 1) < at("cpu", i):
            fail(f"pair {i}: the CPU group expected the previous streamed group's output back first")


def schedule_of(plan, arena_bytes: Callable[[int], int]) -> HybridSchedule:
    """The schedule of a hybrid plan; arena_bytes(layer): that block's arena size (its slots' layout)."""
    if not plan.placement.is_hybrid:
        raise HelmcError(f"hybrid schedule: expected a plan with streamed groups, found {plan.describe()}")
    pairs, cpu_kv, gpu_kv = [], 0, 0
    groups = plan.placement.groups
    for i in range(0, len(groups), 2):
        c, s = groups[i], groups[i + 1]
        slots, off = [], 0
        for layer in s.layers:
            slots.append(RingSlot(layer, off, arena_bytes(layer)))
            off = slots[-1].end
        pairs.append(Pair(i // 2, tuple(c.layers), cpu_kv, tuple(slots), gpu_kv))
        cpu_kv, gpu_kv = cpu_kv + c.num_layers, gpu_kv + s.num_layers
    return HybridSchedule(tuple(pairs), tuple(plan.placement.gpu_layers), max(p.ring_end for p in pairs),
                          token_ops(len(pairs)))
