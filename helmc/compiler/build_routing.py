"""A mixture of experts' routing statistics measured at build, where that is cheap: the bundle just written is run on
this machine's CPU (every block on the CPU stage, whatever its plan) over the calibration prompt
(runtime/moe_routing.py), the counts stored in it (expert_stats.json) and its plan made again from them, so a fresh
bundle holds its hottest experts in VRAM from the start. Elsewhere `helmc calibrate` measures them on the target.

Cheap: the routed experts at most BUILD_ROUTING_MAX_BYTES (a prompt through the whole model on the build host's
CPU takes seconds), the compiled CPU code runs on this CPU, and the bundle is unsigned (its manifest is rewritten).
"""
from __future__ import annotations

from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan

BUILD_ROUTING_MAX_BYTES = 1 << 30


def routing_is_cheap(spec: ModelSpec, cpu_required: tuple[str, ...], signer) -> bool:
    from helmc.planner.moe import expert_bytes
    from helmc.runtime.bundle.manifest import host_cpu_flags
    return (spec.moe is not None and signer is None and expert_bytes(spec) <= BUILD_ROUTING_MAX_BYTES
            and set(cpu_required) <= host_cpu_flags())


def measure_at_build(bundle_dir: str, spec: ModelSpec, plan: Plan, replan) -> Plan:
    """Count the bundle's routing on this CPU, store the counts and `replan(stats)` (the build's search with them)
    in the bundle; returns the plan stored."""
    from helmc.runtime.bundle.expert_stats import store_expert_stats
    from helmc.runtime.bundle.plan import all_cpu_plan
    from helmc.runtime.moe_routing import measure_routing
    from helmc.runtime.session import Session
    on_cpu = all_cpu_plan(spec.num_layers, plan.memory.max_context).replace(
        batch=plan.workload.batch, architecture_hash=plan.provenance.architecture_hash)
    session = Session.load(bundle_dir, quiet=True, plan=on_cpu)
    stats = measure_routing(session, source="build")
    del session
    new = replan(stats)
    store_expert_stats(bundle_dir, stats, plan=new)
    return new
