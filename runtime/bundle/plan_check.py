"""A plan is data: every number in it that sizes memory is checked against the model and the machine before the
runtime allocates anything by it.

The bundle's own plan.json is covered by the manifest (and its signature), but a plan given with `--plan` is made
on the target machine, where no private key is, so it is unauthenticated: a `max_context` of 10^12 would otherwise
size the KV caches' page tables until the kernel's OOM killer ends the process. `check_plan` refuses such a plan in
one line. The model's limits (context within the model's window, layer ranges, batch) hold for every plan; the
machine's (byte budgets within the RAM and VRAM this machine has) for a plan made for this machine (`--plan`),
not for a bundle's own plan, which may have been made for a larger machine and runs here with what there is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import PARTS, Plan

MAX_BATCH = 1024                      # far above any plan the planner makes (serve's slots), far below a bad file's
# Byte fields of a plan's memory budget it sizes host memory by, and those it sizes VRAM by.
HOST_BYTE_FIELDS = ("cpu_bytes", "cpu_weight_bytes")
DEVICE_BYTE_FIELDS = ("gpu_bytes", "gpu_weight_bytes", "gpu_kv_pool_bytes", "prefill_staging_bytes", "expert_staging_bytes",
                      "staging_ring_bytes", "usable_vram_bytes")


@dataclass(frozen=True)
class MachineMemory:
    """What this machine has: host RAM (MemTotal) and the GPU's VRAM in bytes; 0 where it cannot be read."""
    host_bytes: int
    vram_bytes: int


def machine_memory(with_gpu: bool) -> MachineMemory:
    """This machine's RAM, and its GPU's VRAM when with_gpu (CuPy is imported only then)."""
    host = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    host = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    vram = 0
    if with_gpu:
        try:
            import cupy as cp
            vram = int(cp.cuda.runtime.memGetInfo()[1])
        except Exception:      # no CUDA here: loading the GPU stage says so in its own words
            vram = 0
    return MachineMemory(host, vram)


def _numbers_sane(plan: Plan, where: str) -> None:
    """Every number finite, every time and size >= 0 (the dataclass checks the plan's internal sums)."""
    pl, pr = plan.placement, plan.predictions
    rows = [(f"plan {part}", getattr(plan, part)) for part in PARTS] \
        + [(f"plan candidate {i}", c) for i, c in enumerate(pr.candidates)] \
        + [(f"plan hybrid candidate {i}", c) for i, c in enumerate(pr.hybrid_candidates)] \
        + [(f"plan group {i}", g) for i, g in enumerate(pl.groups)]
    for what, row in rows:
        for f in fields(row):
            v = getattr(row, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v) or v < 0:
                raise HelmcError(f"{where}: {what} {f.name} expected a finite number >= 0, found {v!r}")


def check_plan(plan: Plan, spec: ModelSpec, own: Plan, where: str = "plan",
               machine: MachineMemory | None = None) -> None:
    """Refuse, in one line naming the field, a plan this model cannot run: its layers, batch, context and
    token counts against the model spec and the bundle's own plan (own); with machine, its byte budgets against
    the RAM and VRAM that exist. Called before any weight, KV page or staging buffer is allocated."""
    pl, mem, wl = plan.placement, plan.memory, plan.workload
    _numbers_sane(plan, where)
    if pl.num_layers != spec.num_layers:
        raise HelmcError(f"{where}: num_layers expected the model's {spec.num_layers}, found {pl.num_layers}")
    if wl.batch != own.workload.batch or not 1 <= wl.batch <= MAX_BATCH:
        raise HelmcError(f"{where}: batch expected the bundle's {own.workload.batch} (1..{MAX_BATCH}), found "
                         f"{wl.batch}")
    if not 1 <= mem.max_context <= spec.max_position_embeddings:
        raise HelmcError(f"{where}: max_context expected 1..{spec.max_position_embeddings} tokens (the model's "
                         f"context window), found {mem.max_context}")
    for name, v in (("prompt_len", wl.prompt_len), ("output_len", wl.output_len),
                    ("prefill_chunk_tokens", pl.prefill_chunk_tokens)):
        if v > mem.max_context:
            raise HelmcError(f"{where}: {name} expected at most max_context ({mem.max_context} tokens), found {v}")
    if spec.moe is not None and (pl.prefill_on_gpu or pl.groups):     # the staging holds dense blocks
        raise HelmcError(f"{where}: a mixture-of-experts model ({spec.architecture}) expected a plain CPU/GPU split, "
                         f"found {'a streamed prefill' if pl.prefill_on_gpu else 'hybrid decode groups'}")
    for g in pl.groups:
        if g.first_layer + g.num_layers > spec.num_layers:
            raise HelmcError(f"{where}: group at block {g.first_layer} of {g.num_layers} blocks expected within the "
                             f"model's {spec.num_layers} blocks")
    if machine is not None:
        _fits_machine(plan, machine, where)


def _fits_machine(plan: Plan, machine: MachineMemory, where: str) -> None:
    checks = [(n, machine.host_bytes, "host RAM") for n in HOST_BYTE_FIELDS]
    if plan.placement.uses_gpu:
        checks += [(n, machine.vram_bytes, "VRAM") for n in DEVICE_BYTE_FIELDS]
    for name, have, what in checks:
        v = getattr(plan.memory, name)
        if have and v > have:
            raise HelmcError(f"{where}: {name} expected at most this machine's {have} B of {what}, found {v} B")
