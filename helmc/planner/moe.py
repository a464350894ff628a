"""Planning a mixture-of-experts model: its routed experts are computed by the CPU from host RAM wherever their
block's attention runs (runtime/moe_gpu.py on a GPU stage, runtime/moe_experts.py on the CPU stage).

So the split search runs over the model without its routed experts (what the GPU may hold: attention, norms,
router, dense blocks, head), and the experts add the same to every split:
  - host RAM: every expert's bytes (mmapped, bound once);
  - time per decode step: the expert bytes the step's tokens select, read at the rate of the CPU's one-call expert
    sum at the number of host experts a token selects per block where the profile measured it (cpu.expert_sum_reads,
    one-row steps of quantized experts; `helmc calibrate` on a MoE bundle), else at the CPU's GEMV rate for their
    types (named in Plan.predictions.fallbacks) (a token selects top_k of num_experts per block; a step of B tokens selects E (1 - (1 - k/E)^B) distinct
    experts on average: routing is taken as uniform, which random weights give and trained routers approach over
    a long text), plus two crossings per routed block on a GPU stage (m and the logits down, the sum up), each
    at the link's latency and bandwidth.
VRAM the split leaves beyond its KV for the workload's context holds experts (Plan.placement.gpu_experts), the same count in
every routed block of the GPU stage; the GPU computes those while the CPU computes the rest, so a step's experts
take the longer of the two. Which experts: with routing statistics (ExpertStats, measured on a calibration prompt and
stored in the bundle) each block's most often selected, and the predicted hit rate (Plan.predictions.expert_hit_rate) is the
share of the blocks' selections they took; without, routing is taken as uniform, the lowest indices are held and the
hit rate is the share held (named in Plan.predictions.fallbacks).
A prompt's experts run on the GPU: the host experts' weights cross PCIe into a ring of EXPERT_STAGING_GROUPS groups of
EXPERT_STAGING_EXPERTS experts (Plan.memory.expert_staging_bytes, taken from the same spare VRAM before any expert is
placed there), a group copying while the one before computes (runtime/moe_prefill.py).
Assumed: prefill costs as the split search says (the experts' prefill GEMMs are not modelled).
"""
from __future__ import annotations

import dataclasses

from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.planner.analyze_program import PartitionUnit, ProgramAnalysis, StageLoad
from helmc.runtime.bundle.expert_stats import ExpertStats
from helmc.runtime.bundle.plan import Plan

# Plan.predictions.fallbacks' entry for a plan that held experts in VRAM without routing statistics.
UNIFORM_ROUTING = "expert routing: uniform (no routing statistics; helmc calibrate measures them)"
# ... for a plan whose GPU stage has routed blocks with experts on the host, on a profile without the host half's time
# (gpu.moe_host_half_ms, from helmc calibrate on such a bundle): only the crossings' link time is priced.
HOST_WAIT_UNPRICED = ("moe: a routed GPU block with experts on the host waits for the host every step; only its "
                      "crossings' link time is priced, not the host's work around them (gpu.moe_host_half_ms: not "
                      "measured; helmc calibrate on a mixture-of-experts bundle measures it)")
# ... and for a one-row plan of quantized experts whose profile has no rate for the CPU's one-call expert sum.
EXPERT_SUM_UNMEASURED = ("cpu.expert_sum_reads: not measured (helmc calibrate on a mixture-of-experts bundle); the "
                         "CPU's experts priced at the GEMV rate")


# A prompt's host experts cross PCIe (and quantized experts are dequantized for the GEMMs) once per prefill chunk, so
# a mixture of experts prefills in whole chunks this large whatever prompt its plan was made for (Workload.
# whole_chunks; the chunk's activations planned): a 2048-token prompt reads its experts once. On an H200, gpt-oss-20b
# planned for 128-token prompts ran a 2048-token one in 16 chunks, 2.2 s on the GPU alone; 4096-token chunks left no
# VRAM for the staging ring under 4 GiB.
MOE_PREFILL_CHUNK_TOKENS = 2048
EXPERT_STAGING_EXPERTS = 16      # experts per group of the prefill's staging ring: ~42 MB of Qwen3-30B-A3B Q4_K
EXPERT_STAGING_GROUPS = 2        # one group copies while the other computes


def expert_bytes_by_type(spec: ModelSpec, layer: int) -> dict[str, int]:
    """Block `layer`'s routed experts' weight bytes as stored, per type (a weight type, or the checkpoint dtype)."""
    out: dict[str, int] = {}
    if not spec.is_moe_layer(layer):
        return out
    shapes = spec.block_weight_shapes(layer)
    for e in range(spec.moe.num_experts):
        for name in spec.moe.expert_weight_names(e):
            t = spec.weight_type(layer, name)
            out[t or spec.dtype] = out.get(t or spec.dtype, 0) + spec.tensor_bytes(shapes[name], t)
    return out


def expert_bytes(spec: ModelSpec) -> int:
    return sum(sum(expert_bytes_by_type(spec, i).values()) for i in range(spec.num_layers))


def without_experts(a: ProgramAnalysis, spec: ModelSpec) -> ProgramAnalysis:
    """`a` with each routed block's experts taken out of its weights: what the split search places."""
    units = list(a.units)
    for i in range(spec.num_layers):
        n = sum(expert_bytes_by_type(spec, i).values())
        if n:
            u = units[i + 1]
            units[i + 1] = dataclasses.replace(u, param_bytes=u.param_bytes - n, stored_bytes=u.stored_bytes - n)
    prefix = [StageLoad()]
    for u in units:
        prefix.append(prefix[-1] + StageLoad.of(u))
    return dataclasses.replace(a, units=tuple(units), prefix=tuple(prefix))


def distinct_share(spec: ModelSpec, batch: int) -> float:
    """The share of a block's experts a decode step of `batch` tokens selects, on average, under uniform routing."""
    k, E = spec.moe.top_k, spec.moe.num_experts
    return 1.0 - (1.0 - k / E) ** batch


def expert_step_ms(spec: ModelSpec, hw: HardwareProfile, batch: int, gpu_moe_blocks: int,
                   in_vram: "float | dict[int, float]" = 0.0) -> tuple[float, float]:
    """(ms a decode step spends on the routed experts, bytes of experts it reads): the CPU's reads of the share
    not in VRAM and the GPU's of the share `in_vram` (one for every block, or per block index: the share of its
    selections whose expert is in VRAM), at once, and per routed block of the GPU stage that waits on the host
    (`gpu_moe_blocks`: its experts not all in VRAM) the two crossings and the host's half between them
    (gpu.moe_host_half_ms, where calibrated). The CPU's share of a one-row step at the one-call expert sum's measured
    rate for the host experts a token selects there (cpu.expert_sum_reads), else at the GEMV rate of each weight type."""
    share = distinct_share(spec, batch)
    cpu_s = gpu_s = read = 0.0
    for i in range(spec.num_layers):
        hit = in_vram.get(i, 0.0) if isinstance(in_vram, dict) else in_vram
        by_type = expert_bytes_by_type(spec, i)
        one_call = expert_sum_gbs(spec, hw, i, batch, hit) if by_type else 0.0
        for t, n in by_type.items():
            cpu_s += share * n * (1 - hit) / ((one_call or hw.cpu.read_gbs(t, batch)) * 1e9)
            if hit:
                gpu_s += share * n * hit / (hw.gpu.read_gbs(t) * 1e9)
            read += share * n
    seconds = max(cpu_s, gpu_s)
    if gpu_moe_blocks and hw.link is not None:
        crossing = batch * (2 * spec.hidden_size * 2 + spec.moe.num_experts * 4)     # m + logits down, y up
        seconds += gpu_moe_blocks * (2 * hw.link.latency_us * 1e-6 + crossing / (hw.link.h2d_gbs * 1e9))
    if gpu_moe_blocks and hw.gpu is not None and hw.gpu.moe_host_half_ms is not None:
        seconds += gpu_moe_blocks * hw.gpu.moe_host_half_ms * 1e-3
    return 1e3 * seconds, read


def expert_gate_type(spec: ModelSpec, layer: int) -> str | None:
    """Block `layer`'s experts' gate/up weight type (None: float experts): what names its one-call expert sum."""
    return spec.weight_type(layer, spec.moe.expert_weight_names(0)[0])


def expert_sum_gbs(spec: ModelSpec, hw: HardwareProfile, layer: int, batch: int, hit: float) -> float:
    """The one-call expert sum's measured rate for a one-row step's host experts of block `layer` (top_k x the share
    not in VRAM of them per token), or 0: a batched step, float experts, or not measured."""
    t = expert_gate_type(spec, layer)
    if batch != 1 or t is None:
        return 0.0
    return hw.cpu.expert_sum_gbs(t, max(1.0, spec.moe.top_k * (1 - hit)))


def with_experts(p: Plan, spec: ModelSpec, hw: HardwareProfile, stats: "ExpertStats | None" = None) -> Plan:
    """The split search's plan (over the model without its experts) with the experts' time and host memory added
    to every candidate, as to the chosen split; `stats` (routing statistics) pick the experts held in VRAM."""
    held = expert_bytes(spec)
    ram = hw.cpu.ram_free_bytes

    def moe_blocks_on_gpu(cpu_units: int) -> int:
        return sum(1 for i in range(spec.num_layers) if spec.is_moe_layer(i) and i + 1 >= cpu_units)

    def add(c):
        t, _ = expert_step_ms(spec, hw, p.workload.batch, moe_blocks_on_gpu(c.cpu_units) if c.gpu_units else 0)
        fits = c.feasible and (not ram or c.cpu_bytes + held <= ram)
        why = c.why if fits or not c.feasible else (f"host RAM: the experts' {held / 2**30:.2f} GiB do not fit "
                                                    f"beside {c.cpu_bytes / 2**30:.2f} GiB in {ram / 2**30:.2f} GiB free")
        return dataclasses.replace(c, t_cpu_ms=c.t_cpu_ms + t, t_plan_ms=c.t_plan_ms + t,
                                   cpu_bytes=c.cpu_bytes + held, feasible=fits, why=why)
    candidates = tuple(add(c) for c in p.predictions.candidates)
    if candidates and not any(c.feasible for c in candidates):
        raise HelmcError(f"plan: the mixture of experts' {held / 2**30:.2f} GiB of experts expected to fit in host "
                         f"RAM ({ram / 2**30:.2f} GiB free) beside the rest, found no split where they do")
    gpu_blocks = moe_blocks_on_gpu(p.placement.cpu_units) if p.placement.uses_gpu else 0
    staging = expert_staging_bytes(p, spec, gpu_blocks)
    p = p.replace(gpu_bytes=p.memory.gpu_bytes + staging, gpu_kv_pool_bytes=p.memory.gpu_kv_pool_bytes - staging,
                  expert_staging_bytes=staging)
    if stats is not None:
        stats.check_for(spec)
    vram, per_block = experts_in_vram(p, spec, gpu_blocks, stats)
    in_vram = hit_by_block(spec, vram, stats)
    # the GPU stage's routed blocks that wait on the host: a block with every expert in VRAM is routed on the GPU
    waiting = sum(1 for i in range(spec.num_layers) if spec.is_moe_layer(i) and i + 1 >= p.placement.cpu_units
                  and (len(vram[i]) if vram else 0) < spec.moe.num_experts) if gpu_blocks else 0
    t, _ = expert_step_ms(spec, hw, p.workload.batch, waiting, in_vram)
    fallbacks = p.predictions.fallbacks
    routed = sum(1 for i in range(spec.num_layers) if spec.is_moe_layer(i))
    on_host = per_block < spec.moe.num_experts or len([ids for ids in vram if ids]) < routed
    # which experts are hot matters only where some stay on the host, and so does the CPU's expert-sum rate
    if stats is None and vram and on_host:
        fallbacks += (UNIFORM_ROUTING,)
    if waiting and (hw.gpu is None or hw.gpu.moe_host_half_ms is None):
        fallbacks += (HOST_WAIT_UNPRICED,)
    if on_host and p.workload.batch == 1 and any(t and not hw.cpu.expert_sum_gbs(t, 1) for t in
                                     {expert_gate_type(spec, i) for i in range(spec.num_layers) if spec.is_moe_layer(i)}):
        fallbacks += (EXPERT_SUM_UNMEASURED,)
    vram_bytes = sum(sum(expert_bytes_by_type(spec, i).values()) * len(ids) // spec.moe.num_experts
                     for i, ids in enumerate(vram))
    # With experts both in VRAM and on the host, the VRAM expert cache refreshes which ones hold the slots from the
    # tokens' routing (runtime/moe_expert_cache.py), one sequence or a served batch: the calibration prompt's routing
    # need not be the decode rows' (a batch of 8 on Qwen3-30B-A3B's peer file: 0.52 of its selections in VRAM with
    # the plan's slots kept, where every row's experts fit). A row's bits then follow the residency it meets, in a
    # batch as alone; with the same residency a batched row equals its single run (tests/runtime/test_moe_gpu.py).
    # Not for biased experts (gpt-oss): their VRAM biases are stacked by slot once at load (LayerExperts.vram_biases,
    # captured by the CUDA graphs), which the cache's copies would not move with the weights.
    cache = on_host and any(vram) and not spec.moe.expert_bias
    if not p.placement.groups and 0 <= p.placement.cpu_units < len(candidates):
        # the chosen split's row as the plan prices it (its experts in VRAM); the others' rows assume none there
        c = p.predictions.candidates[p.placement.cpu_units]
        chosen = dataclasses.replace(candidates[p.placement.cpu_units], t_cpu_ms=c.t_cpu_ms + t, t_plan_ms=c.t_plan_ms + t)
        candidates = candidates[:p.placement.cpu_units] + (chosen,) + candidates[p.placement.cpu_units + 1:]
    # the experts in VRAM are bound there, not in host RAM (under the cache every expert's host rows are kept)
    mem = p.memory
    host_less = 0 if cache else vram_bytes
    return p.replace(t_cpu_ms=p.predictions.t_cpu_ms + t, t_plan_ms=p.predictions.t_plan_ms + t,
                     cpu_bytes=mem.cpu_bytes + held - host_less, cpu_weight_bytes=mem.cpu_weight_bytes + held - host_less,
                     expert_cache=cache,
                     candidates=candidates, gpu_experts=vram, expert_hit_rate=predicted_hit_rate(spec, in_vram, vram),
                     fallbacks=fallbacks, gpu_bytes=mem.gpu_bytes + vram_bytes,
                     gpu_weight_bytes=mem.gpu_weight_bytes + vram_bytes,
                     gpu_kv_pool_bytes=mem.gpu_kv_pool_bytes - vram_bytes if mem.gpu_kv_pool_bytes else 0)


def expert_staging_bytes(p: Plan, spec: ModelSpec, gpu_blocks: int) -> int:
    """VRAM for the prefill's ring of streamed host experts (the module's note): the largest expert's bytes times the
    ring's experts, when the GPU stage has routed blocks and the VRAM the plan leaves holds it (else 0: the CPU
    computes a prompt's host experts). Biased experts (gpt-oss): with every expert's biases of those blocks on the
    device beside the ring (moe_prefill.ExpertPrefill._device_biases)."""
    if not gpu_blocks or not p.memory.usable_vram_bytes:
        return 0
    blocks = [i for i in range(spec.num_layers) if spec.is_moe_layer(i) and i + 1 >= p.placement.cpu_units]
    per_expert = max(sum(expert_bytes_by_type(spec, i).values()) for i in blocks) // spec.moe.num_experts
    ring = EXPERT_STAGING_GROUPS * EXPERT_STAGING_EXPERTS * per_expert
    from helmc.runtime.moe_prefill import device_bias_bytes
    ring += device_bias_bytes(spec.moe, spec.hidden_size, spec.dtype_bytes, len(blocks))     # gpt-oss's biases
    spare = vram_spare(p, spec)
    every_expert = sum(sum(expert_bytes_by_type(spec, i).values()) for i in blocks)
    return ring if ring <= spare < every_expert else 0    # none when every expert fits in VRAM: nothing streams


def vram_spare(p: Plan, spec: ModelSpec) -> int:
    """The VRAM a plan leaves beyond what it needs: usable minus planned, and its KV pool beyond the workload's
    context."""
    from helmc.planner.cost_model import whole_pages
    kv_need = (p.workload.batch * whole_pages(p.workload.prompt_len + p.workload.output_len)
               * p.placement.gpu_units * 2 * spec.num_kv_heads * spec.head_dim * 2)   # fp16 K and V
    return max(0, min(p.memory.usable_vram_bytes - p.memory.gpu_bytes, p.memory.gpu_kv_pool_bytes - kv_need))


def experts_in_vram(p: Plan, spec: ModelSpec, gpu_blocks: int, stats: "ExpertStats | None" = None
                    ) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(Plan.placement.gpu_experts, experts per routed GPU block): the VRAM the plan leaves beyond what it needs
    (p.memory.usable_vram_bytes - p.memory.gpu_bytes: its KV pool beyond the workload's context) in whole experts,
    the same count in every routed block of the GPU stage: each block's most often selected under `stats`, else the
    lowest indices."""
    if not gpu_blocks or not p.memory.usable_vram_bytes:
        return (), 0
    blocks = [i for i in range(spec.num_layers) if spec.is_moe_layer(i) and i + 1 >= p.placement.cpu_units]
    per_expert = max(sum(expert_bytes_by_type(spec, i).values()) for i in blocks) // spec.moe.num_experts
    spare = vram_spare(p, spec)
    n = min(spec.moe.num_experts, spare // (per_expert * len(blocks)))
    if n == 0:
        return (), 0
    def held(i):
        return stats.hottest(i, n) if stats is not None else tuple(range(n))
    return tuple(held(i) if i in blocks else () for i in range(spec.num_layers)), n


def hit_by_block(spec: ModelSpec, vram: tuple, stats: "ExpertStats | None") -> dict[int, float]:
    """{block: the share of its selections whose expert is in VRAM} for the blocks holding some: the share the
    statistics predict for their hottest experts on tokens other than those that chose them (ExpertStats.
    predicted_mass; experts_in_vram holds each block's hottest), or under uniform routing the share held."""
    return {i: stats.predicted_mass(i, len(ids)) if stats is not None else len(ids) / spec.moe.num_experts
            for i, ids in enumerate(vram) if ids}


def predicted_hit_rate(spec: ModelSpec, hit: dict[int, float], vram: tuple) -> float:
    """The share of a token's selected experts, over every routed block, found in VRAM (Plan.predictions.expert_hit_rate)."""
    routed = sum(1 for i in range(spec.num_layers) if spec.is_moe_layer(i))
    return sum(hit.values()) / routed if vram and routed else 0.0


__all__ = ["PartitionUnit", "distinct_share", "expert_bytes", "expert_step_ms", "with_experts", "without_experts"]
