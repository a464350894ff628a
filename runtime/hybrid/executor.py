"""Runs one hybrid decode token: the schedule's ops in order, on a backend (runtime/hybrid/cuda_backend.py on the
GPU; the tests' recording backend on the CPU). The token loop decides nothing here: the plan fixed the groups,
schedule.py the order, ring slots and KV indices.

A backend has one method per op kind (schedule.OP_KINDS):
    begin(cos, sin)            open the step: RoPE rows to the GPU, the GPU cache's step begun
    copy(pair)                 copy stream: wait ring_free, the group's arenas into their slots, record copied[i]
    cpu(pair, x) -> x          C_i on the CPU, host activation in and out
    to_gpu(x) -> x             host -> device
    wait_copy(pair)            compute stream waits copied[i]
    gpu(pair, x) -> x          S_i on the GPU from the ring, device activation in and out
    release_ring(pair)         compute stream: record ring_free
    to_host(x) -> x            device -> host (synchronous)
    resident(x) -> logits      GPU-resident blocks and the head (commits the GPU cache's step); host logits
    finish()                   commit the CPU cache's step
Invariant (asserted at every op): the activation is where the op needs it (host for cpu and to_gpu, device for
gpu, to_host and resident), so a schedule that forgot a crossing fails here instead of reading stale memory.
"""
from __future__ import annotations

from helmc.errors import HelmcError
from helmc.runtime.hybrid.schedule import HybridSchedule

_NEEDS = {"cpu": "host", "to_gpu": "host", "gpu": "device", "to_host": "device", "resident": "device"}
_MOVES = {"to_gpu": "device", "to_host": "host"}


class HybridDecode:
    def __init__(self, schedule: HybridSchedule, backend):
        self.schedule, self.backend = schedule, backend
        self.tokens = 0

    def step(self, x, cos, sin):
        """x [1, H] on the host (the embedding row), cos/sin [1, D] on the host -> logits [1, V] on the host."""
        b, pairs = self.backend, self.schedule.pairs
        where, logits = "host", None
        for op in self.schedule.ops:
            need = _NEEDS.get(op.kind)
            if need is not None and need != where:
                raise HelmcError(f"hybrid decode: {op.kind} {op.pair} expected the activation on the {need}, "
                                 f"found it on the {where}")
            p = pairs[op.pair] if op.pair >= 0 else None
            if op.kind == "begin":
                b.begin(cos, sin)
            elif op.kind == "copy":
                b.copy(p)
            elif op.kind == "cpu":
                x = b.cpu(p, x)
            elif op.kind == "to_gpu":
                x = b.to_gpu(x)
            elif op.kind == "wait_copy":
                b.wait_copy(p)
            elif op.kind == "gpu":
                x = b.gpu(p, x)
            elif op.kind == "release_ring":
                b.release_ring(p)
            elif op.kind == "to_host":
                x = b.to_host(x)
            elif op.kind == "resident":
                logits = b.resident(x)
            elif op.kind == "finish":
                b.finish()
            where = _MOVES.get(op.kind, where)
        self.tokens += 1
        return logits
