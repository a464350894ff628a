"""Partition search (thesis 4.1.3, Algorithm 1): every split k over all partition units, scored
with the roofline cost model, infeasible ones marked, the fastest feasible one chosen; then hybrid decode's
layouts (planner/hybrid.py), chosen over the splits only where one predicts a faster token.

k is the number of units on the CPU (0 = all on the GPU, num_units = all on the CPU). Each
candidate's stages come from prefix sums (`ProgramAnalysis.stage`), so the search is O(L).
"""
from __future__ import annotations

import dataclasses

from helmc.planner.analyze_program import ProgramAnalysis, StageLoad, analyze_program
from helmc.planner.budget import budgeted
from helmc.planner.cost_model import (PREFILL_CHUNK_TOKENS, DeviceRates, Workload, comm_time_ms, gpu_kv_resident_bytes, gpu_prefill_tokens, kv_page_pool_bytes,
                         max_context, memory_needs, prefill_staging_bytes, rate_fallbacks, shortfall_text, stage_time)
from helmc.errors import HelmcError
from helmc.planner.hybrid import best_per_pair_count, choose_layout, search_hybrid
from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import (Candidate, MemoryBudget, Placement, Plan, PlanWorkload, Predictions,
                                       Provenance, describe_split)


class InfeasibleError(HelmcError):
    """No split fits; the message names the device(s) and how much memory is missing."""


def evaluate_split(a: ProgramAnalysis, hw: HardwareProfile, w: Workload, k: int,
                   cpu_rates: DeviceRates, gpu_rates: DeviceRates | None) -> tuple[Candidate, float]:
    """One row of the search: times, memory and feasibility of split k; also its total memory
    shortfall in bytes (inf where no amount of memory would do)."""
    n = a.num_units
    cpu, gpu = a.stage(0, k), a.stage(k, n)
    host_need, gpu_need = memory_needs(a, hw, cpu, gpu, w)
    t_cpu = stage_time(a, cpu, cpu_rates, w, blend_l3=True).total_ms
    if gpu.units and gpu_rates is None:                 # no memory would make this split fit
        return Candidate(cpu_units=k, gpu_units=n - k, t_cpu_ms=t_cpu, t_gpu_ms=0.0, t_comm_ms=0.0,
                         t_plan_ms=t_cpu, gpu_bytes=gpu_need.total, cpu_bytes=host_need.total, feasible=False,
                         why="no GPU in the hardware profile"), float("inf")
    t_gpu = t_over = t_comm = 0.0
    if gpu.units:
        resident = gpu_kv_resident_bytes(gpu_need) if w.kv_offload else None
        st = stage_time(a, gpu, gpu_rates, w, blend_l3=False, kv_resident_bytes=resident, link=hw.link)
        t_gpu, t_over = st.total_ms, st.overhead_ms
        t_comm = comm_time_ms(a, k, w, hw.link)
    # Needs are counted in whole KV pages, so fitting S + T implies max_context >= S + T.
    feasible = host_need.fits and gpu_need.fits
    limit = max_context(a, hw, cpu, gpu, w) if feasible else 0
    assert not feasible or limit >= w.total_context, (k, limit, w.total_context)
    cand = Candidate(cpu_units=k, gpu_units=n - k, t_cpu_ms=t_cpu, t_gpu_ms=t_gpu, t_comm_ms=t_comm,
                     t_plan_ms=t_cpu + t_gpu + t_comm, gpu_bytes=gpu_need.total, cpu_bytes=host_need.total,
                     feasible=feasible, why="" if feasible else shortfall_text(host_need, gpu_need),
                     t_overhead_ms=t_over, max_context=limit)
    return cand, host_need.shortfall + gpu_need.shortfall


def _explain(c, best, hybrid: bool = False) -> str:
    if not hybrid and c.cpu_units == best.cpu_units:
        return "chosen: fastest feasible split"
    than = " than the hybrid layout" if hybrid else ""
    return (f"slower by {c.t_plan_ms - best.t_plan_ms:.2f} ms{than} (T_cpu {c.t_cpu_ms - best.t_cpu_ms:+.2f}, "
            f"T_gpu {c.t_gpu_ms - best.t_gpu_ms:+.2f}, T_comm {c.t_comm_ms - best.t_comm_ms:+.4f})")


def search_partition(a: ProgramAnalysis, hw: HardwareProfile, w: Workload) -> Plan:
    """Algorithm 1 over k = 0..num_units, then the hybrid layouts (planner/hybrid.py); raises InfeasibleError
    when no split fits. A hybrid layout is chosen only where it predicts a faster token than every split."""
    if w.total_context > a.max_position_embeddings:
        raise HelmcError(f"workload: prompt + output expected <= max_position_embeddings "
                         f"({a.max_position_embeddings}), found {w.total_context}")
    # A batched decode step (w.batch sequences) reads each CPU weight once for all rows, at the m-row GEMVs' rate.
    cpu_rates = DeviceRates.of_device(hw, "cpu", analysis=a, rows=w.batch if w.objective == "decode" else 1)
    gpu_rates = DeviceRates.of_device(hw, "gpu", analysis=a) if hw.gpu is not None else None
    rows, shortfalls = [], []
    for k in range(a.num_units + 1):
        cand, short = evaluate_split(a, hw, w, k, cpu_rates, gpu_rates)
        rows.append(cand)
        shortfalls.append(short)
    feasible = [c for c in rows if c.feasible]
    if not feasible:
        closest = min(range(len(rows)), key=lambda k: (shortfalls[k], k))
        raise InfeasibleError(
            f"the model fits on no split of this hardware for context {w.total_context} at batch {w.batch}: "
            f"the closest, {describe_split(closest, a.num_units)}, has {rows[closest].why}")
    best = min(feasible, key=lambda c: (c.t_plan_ms, c.cpu_units))     # ties: fewer units on the CPU
    layouts = best_per_pair_count(search_hybrid(a, hw, w, cpu_rates, gpu_rates)) if gpu_rates else []
    hybrid = choose_layout(layouts, w.batch)
    if hybrid is not None and hybrid.candidate.t_plan_ms >= best.t_plan_ms:
        hybrid = None                                                   # ties and losses: the plain split
    chosen = hybrid.candidate if hybrid else best
    rows = [dataclasses.replace(c, why=_explain(c, chosen, hybrid is not None)) if c.feasible else c for c in rows]
    cpu, gpu = a.stage(0, chosen.cpu_units), a.stage(chosen.cpu_units, a.num_units)
    if hybrid:
        streamed = StageLoad()
        for g in hybrid.groups:
            if g.kind == "streamed":
                streamed = streamed + a.stage(g.first_layer + 1, g.first_layer + 1 + g.num_layers)
        _, gpu_need = memory_needs(a, hw, cpu, gpu, w, streamed=streamed, ring_bytes=chosen.ring_bytes)
        groups, t_copy_ms, ring = hybrid.groups, chosen.t_copy_ms, chosen.ring_bytes
    else:
        _, gpu_need = memory_needs(a, hw, cpu, gpu, w)
        groups, t_copy_ms, ring = (), 0.0, 0
    staging = prefill_staging_bytes(a, cpu, gpu, w)
    kv_pool = kv_page_pool_bytes(gpu_need) if gpu.units else 0
    return Plan(
        Placement(num_layers=a.num_layers, cpu_units=chosen.cpu_units, groups=groups, prefill_on_gpu=staging > 0,
                  prefill_chunk_tokens=gpu_prefill_tokens(w) if gpu.units else 0),
        Predictions(t_cpu_ms=chosen.t_cpu_ms, t_gpu_ms=chosen.t_gpu_ms, t_comm_ms=chosen.t_comm_ms,
                    t_plan_ms=chosen.t_plan_ms, t_copy_ms=t_copy_ms, candidates=tuple(rows),
                    hybrid_candidates=tuple(e.candidate for e in layouts) if hybrid else (),
                    fallbacks=rate_fallbacks(hw, w)),
        MemoryBudget(max_context=chosen.max_context, cpu_bytes=chosen.cpu_bytes, gpu_bytes=chosen.gpu_bytes,
                     cpu_weight_bytes=a.held_bytes(cpu), gpu_weight_bytes=a.held_bytes(gpu) if gpu.units else 0,
                     usable_vram_bytes=hw.usable_vram_bytes, ram_free_bytes=hw.cpu.ram_free_bytes,
                     gpu_kv_pool_bytes=kv_pool if gpu.units else 0, prefill_staging_bytes=staging,
                     staging_ring_bytes=ring),
        PlanWorkload(objective=w.objective, prompt_len=w.prompt_len, output_len=w.output_len, batch=w.batch,
                     kv_offload=w.kv_offload),
        Provenance(hardware_hash=hw.profile_hash()))


def load_spec(model_dir_or_config: "str | ModelSpec") -> ModelSpec:
    if isinstance(model_dir_or_config, ModelSpec):
        return model_dir_or_config
    from helmc.model.load import load_spec as load_model_spec
    return load_model_spec(model_dir_or_config)


def plan(model_dir_or_config: "str | ModelSpec", hardware: "str | HardwareProfile", prompt_len: int = 128,
         output_len: int = 128, batch: int = 1, objective: str = "decode", gpu_budget_gib: float | None = None,
         kv_offload: bool = True, dtype: str | None = None, stream_prefill: bool = True, hybrid: bool = True,
         expert_stats=None) -> Plan:
    """The partition plan for a model (a directory or config.json, a GGUF file, or a ModelSpec) on a hardware
    profile (a hardware.json path, a preset name, or a HardwareProfile). expert_stats: a mixture of experts' routing
    statistics (runtime/bundle/expert_stats.ExpertStats), which pick the experts held in VRAM."""
    spec = load_spec(model_dir_or_config)
    hw = budgeted(hardware, gpu_budget_gib)
    chunk = PREFILL_CHUNK_TOKENS
    if spec.moe is not None:        # a plain split of what is not an expert; the experts stay on the CPU (planner/moe.py)
        from helmc.planner.moe import MOE_PREFILL_CHUNK_TOKENS
        stream_prefill = hybrid = False
        chunk = MOE_PREFILL_CHUNK_TOKENS
    w = Workload(prompt_len=prompt_len, output_len=output_len, batch=batch, objective=objective, kv_offload=kv_offload,
                 stream_prefill=stream_prefill, hybrid=hybrid, prefill_chunk_tokens=chunk,
                 whole_chunks=spec.moe is not None)
    a = analyze_program(spec, dtype)
    if spec.moe is not None:
        from helmc.planner.moe import with_experts, without_experts
        p = with_experts(search_partition(without_experts(a, spec), hw, w), spec, hw, expert_stats)
    else:
        p = search_partition(a, hw, w)
    return p.replace(architecture_hash=spec.architecture_hash())
