"""Hybrid decode: the host's DRAM feeds the CPU and PCIe at once.

A plain split leaves PCIe idle during decode while the CPU stage reads its blocks at the host-memory
ceiling. Hybrid decode splits the host-resident blocks (units [0, k): the embedding and blocks 0..k-2) into
pairs of a CPU group and a streamed group, in that order:

    C_0 S_0 C_1 S_1 ... C_{m-1} S_{m-1} | GPU-resident blocks, head

While the CPU computes C_i, the weights of S_i are copied from pinned host memory into a staging ring in VRAM
(the copy is issued when C_i starts); then the GPU computes S_i from the ring, and C_{i+1} takes S_i's output
back. One ring, the size of the largest streamed group, is reused by every pair, so the VRAM it costs is what
the GPU-resident part gives up.

Cost per token (each term from cost_model, the same rates as a plain split):

    T = sum_i [ overlap(C_i, copy S_i) + T_gpu(S_i) ] + T_gpu(resident) + crossings

overlap() is max(T_cpu(C_i), T_copy(S_i)) under contention: both read host DRAM, and `helmc profile` measured
what helmc's fp16 GEMVs and the copies get running together (link.cpu_read_concurrent_gbs, h2d_concurrent_gbs).
While both run, each is slower than alone by its share of what their demand exceeds that combined rate, and
at least as much slower as the window's own were (Contention.of: for fp16 weights exactly the window's M / M' and
B / B'; quantized GEMVs, whose demand is lower, slow by the window's ratios too); when one finishes, the other
goes on alone.
Crossings: the token ids back, the activation to the GPU before each S_i and back after each S_i but the last
(eq. 4.15 each: latency + bytes / bandwidth). Streamed blocks' KV is the GPU cache's, as a GPU block's.

Only a profile with the concurrent rates measured gets hybrid layouts (no figure is invented); the search
(`search_hybrid`) enumerates ring sizes, pair counts and streamed block counts, and the partition search
takes a layout only where it predicts a faster token than every plain split.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.planner.analyze_program import ProgramAnalysis, StageLoad, analyze_program
from helmc.planner.cost_model import (DeviceRates, StageTime, Workload, comm_time_ms, gpu_kv_resident_bytes,
                                      max_context, memory_needs, shortfall_text, stage_time)
from helmc.hardware.profile import HardwareProfile
from helmc.runtime.bundle.plan import PAIR_TIE_SHARE, HybridCandidate, Plan, PlanGroup

# The model charges a pair its two crossings only (eq. 4.15 each). Beyond them, with each streamed group replayed as a
# CUDA graph (runtime/hybrid/group_graph.py), the executor spent ~0.28 ms of host time a pair (measured on an H200 host,
# 8 pairs: gpu 0.54 + to_host 0.94 + to_gpu 0.78 ms a token, the group's kernels inside to_host's wait), and plans
# of 8-15 pairs came within 2% of measured; the cap keeps the search ~O(L^2).
MAX_PAIRS = 16
# For the same reason a layout with fewer pairs wins a near-tie (PAIR_TIE_SHARE, runtime/bundle/plan.py, where the
# plan's check allows it): measured at 8 sequences, 13 pairs of single blocks predicted 106.3 ms and 5 pairs
# 108.1 ms; the 13 pairs would cross 25 times a step to the 5 pairs' 9.


@dataclass(frozen=True)
class Contention:
    """How much slower the CPU's reads and the host->device copy run while the other runs too (>= 1)."""
    cpu_slowdown: float
    copy_slowdown: float

    @classmethod
    def of(cls, hw: HardwareProfile, cpu_rates: DeviceRates) -> "Contention":
        """From the profile's window, where helmc's fp16 GEMVs (alone M_f = host_read_gbs) and the copies (alone
        B = h2d_gbs) got M' and B', together C = M' + B'. Two effects, the larger slowdown of each side wins:
        - capacity: a model whose GEMVs read M (cpu_rates.mem_gbs: its weight types' mix) demands M + B; what
          exceeds C is lost by each side in the shares the window showed (for fp16 weights: exactly M_f / M' and
          B / B');
        - latency: each side slows at least as the window's did (M_f / M', B / B'), whatever the demand. Quantized
          GEMVs read below DRAM speed because each core waits on its loads between its decode steps, not because
          DRAM is full, and the copies lengthen those waits: Q4_K under 3 GiB (H200 hosts, two runs)
          measured 38.8 / 38.3 ms where capacity alone predicted 34.8 / 31.6 (a demand within C lost nothing) and
          this floor predicts 38.4 / 35.1 (the fp16 runs, whose
          demand exceeds C, are unchanged)."""
        link = hw.link
        if not link.has_concurrent:                # no window measured: nothing to scale (no hybrid is planned)
            return cls(1.0, 1.0)
        m_f = hw.cpu.host_read_gbs or hw.cpu.stream_gbs            # the figure the window's CPU rate was taken beside
        b = link.h2d_gbs
        floor = (max(1.0, m_f / link.cpu_read_concurrent_gbs), max(1.0, b / link.h2d_concurrent_gbs))
        capacity = link.cpu_read_concurrent_gbs + link.h2d_concurrent_gbs
        m = cpu_rates.mem_gbs
        excess = m + b - capacity
        if excess <= 0:
            return cls(*floor)
        cpu_lost, copy_lost = max(0.0, m_f - link.cpu_read_concurrent_gbs), max(0.0, b - link.h2d_concurrent_gbs)
        if cpu_lost + copy_lost <= 0:              # the window lost nothing, this demand exceeds it: share by demand
            cpu_lost, copy_lost = m, b
        cpu_share = cpu_lost / (cpu_lost + copy_lost)
        m_left = max(m - excess * cpu_share, 1e-9 * m)
        b_left = max(b - excess * (1 - cpu_share), 1e-9 * b)
        return cls(cpu_slowdown=max(m / m_left, floor[0]), copy_slowdown=max(b / b_left, floor[1]))


def overlapped_ms(cpu: StageTime, copy_ms: float, c: Contention) -> float:
    """A CPU group and a copy started together: both slowed while both run, the survivor alone after.

    The CPU group's roofline part is DRAM-bound and slows by cpu_slowdown; its overhead (launches, Python) does
    not, but the copy is taken as slowed for the CPU's whole duration (conservative)."""
    t_cpu = cpu.total_ms
    if copy_ms <= 0 or t_cpu <= 0:
        return max(t_cpu, copy_ms)
    a = cpu.overhead_ms + (t_cpu - cpu.overhead_ms) * c.cpu_slowdown    # CPU group, copy running throughout
    b = copy_ms * c.copy_slowdown                                       # copy, CPU running throughout
    if a <= b:
        return a + (1 - a / b) * copy_ms
    return b + (1 - b / a) * t_cpu


@dataclass(frozen=True)
class HybridEval:
    candidate: HybridCandidate
    groups: tuple[PlanGroup, ...]
    shortfall: float                  # memory short in bytes (0 when feasible)


def copy_ms(nbytes: int, hw: HardwareProfile) -> float:
    """One streamed group's weights host -> device alone (eq. 4.15's form)."""
    return hw.link.latency_us * 1e-3 + nbytes / (hw.link.h2d_gbs * 1e9) * 1e3


def crossings_ms(a: ProgramAnalysis, k: int, pairs: int, w: Workload, hw: HardwareProfile) -> float:
    """Token ids back and the activation into the first streamed group (a plain split's crossing), plus the
    activation back and forth around every further pair."""
    link = hw.link
    act = w.batch * a.act_bytes_per_token
    there = link.latency_us * 1e-3 + act / (link.h2d_gbs * 1e9) * 1e3
    back = link.latency_us * 1e-3 + act / (link.d2h_gbs * 1e9) * 1e3
    return comm_time_ms(a, k, w, link) + (pairs - 1) * (there + back)


def evaluate_layout(a: ProgramAnalysis, hw: HardwareProfile, w: Workload, k: int, pairs: tuple[tuple[int, int], ...],
                    cpu_rates: DeviceRates, gpu_rates: DeviceRates, ring_bytes: int | None = None,
                    memo: dict | None = None) -> HybridEval:
    """Times, memory and feasibility of one layout: host units [0, k) as `pairs` of (CPU blocks, streamed
    blocks), in order; ring_bytes: the staging ring (default: the largest streamed group); memo: stage times
    shared between the layouts of one search (the same groups recur in many layouts)."""
    memo = {} if memo is None else memo

    def timed(device: str, lo: int, hi: int, resident_share: float | None) -> StageTime:
        key = (device, lo, hi, resident_share)
        if key not in memo:
            load = a.stage(lo, hi)
            memo[key] = (stage_time(a, load, cpu_rates, w, blend_l3=True) if device == "cpu" else
                         stage_time(a, load, gpu_rates, w, blend_l3=False, link=hw.link,
                                    kv_resident_bytes=_resident(resident_share, load, w)))
        return memo[key]

    n = a.num_units
    assert sum(c + s for c, s in pairs) == k - 1 and all(c >= 1 and s >= 1 for c, s in pairs), (k, pairs)
    loads, unit = [], 1                      # (first unit of the CPU group, its blocks, the streamed group's load)
    for c, s in pairs:
        loads.append((unit, c, a.stage(unit + c, unit + c + s)))
        unit += c + s
    streamed = StageLoad()
    for *_, s_load in loads:
        streamed = streamed + s_load
    ring = max(s_load.stored_bytes for *_, s_load in loads) if ring_bytes is None else ring_bytes
    host, gpu = a.stage(0, k), a.stage(k, n)
    host_need, gpu_need = memory_needs(a, hw, host, gpu, w, streamed=streamed, ring_bytes=ring)
    # The GPU cache's resident KV serves the resident and the streamed blocks alike: each gets the same share.
    share = None
    if w.kv_offload:
        kv_all = w.batch * w.decode_context * (gpu.kv_bytes_per_token + streamed.kv_bytes_per_token)
        share = min(1.0, gpu_kv_resident_bytes(gpu_need) / kv_all) if kv_all else 1.0
    contention = Contention.of(hw, cpu_rates)
    groups, t_cpu, t_gpu, t_copy = [], 0.0, 0.0, 0.0
    for first_unit, c, s_load in loads:
        tc = timed("cpu", 0 if first_unit == 1 else first_unit, first_unit + c, None)    # C_0 holds the embedding
        ts = timed("gpu", first_unit + c, first_unit + c + s_load.blocks, share)
        t_move = copy_ms(s_load.stored_bytes, hw)
        both = overlapped_ms(tc, t_move, contention)
        blocks_bytes = a.stage(first_unit, first_unit + c).stored_bytes          # the group's blocks, no embedding
        groups += [PlanGroup("cpu", first_unit - 1, c, blocks_bytes, tc.total_ms),
                   PlanGroup("streamed", first_unit - 1 + c, s_load.blocks, s_load.stored_bytes, ts.total_ms, t_move,
                             both)]
        t_cpu, t_gpu, t_copy = t_cpu + both, t_gpu + ts.total_ms, t_copy + t_move
    t_gpu += timed("gpu", k, n, share).total_ms
    t_comm = crossings_ms(a, k, len(pairs), w, hw)
    feasible = host_need.fits and gpu_need.fits
    why = "" if feasible else shortfall_text(host_need, gpu_need)
    limit = max_context(a, hw, host, gpu, w, streamed=streamed, ring_bytes=ring) if feasible else 0
    cand = HybridCandidate(cpu_units=k, pairs=len(pairs), streamed_blocks=streamed.blocks, ring_bytes=ring,
                           t_cpu_ms=t_cpu, t_gpu_ms=t_gpu, t_comm_ms=t_comm, t_plan_ms=t_cpu + t_gpu + t_comm,
                           gpu_bytes=gpu_need.total, cpu_bytes=host_need.total, feasible=feasible, why=why,
                           t_copy_ms=t_copy, max_context=limit)
    return HybridEval(cand, tuple(groups), host_need.shortfall + gpu_need.shortfall)


def _resident(share: float | None, load: StageLoad, w: Workload) -> float | None:
    """This stage's resident KV bytes at the mean decode context (None: all of it, KV not offloaded)."""
    if share is None:
        return None
    return share * w.batch * w.decode_context * load.kv_bytes_per_token


def even_split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal counts, the larger first."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def hybrid_applies(hw: HardwareProfile, w: Workload) -> bool:
    """Hybrid layouts are scored for decode on a profile with a GPU and the DRAM + PCIe rates measured together."""
    return (w.hybrid and w.objective == "decode" and hw.gpu is not None and hw.link is not None
            and hw.link.has_concurrent)


def _fits_with_ring(a: ProgramAnalysis, hw: HardwareProfile, w: Workload, k: int, streamed_blocks: int,
                    ring: int) -> bool:
    """Memory check of host units [0, k) with their last `streamed_blocks` blocks streamed (which blocks does
    not change the bytes of a uniform model; layouts are checked exactly afterwards)."""
    host, dev = memory_needs(a, hw, a.stage(0, k), a.stage(k, a.num_units), w,
                             streamed=a.stage(k - streamed_blocks, k), ring_bytes=ring)
    return host.fits and dev.fits


def search_hybrid(a: ProgramAnalysis, hw: HardwareProfile, w: Workload, cpu_rates: DeviceRates,
                  gpu_rates: DeviceRates) -> list[HybridEval]:
    """Every layout tried, feasible or not. For a ring of r blocks, the host part is the least that fits beside
    the ring (a GPU-resident block is always faster than a host one); then every pair count m <= MAX_PAIRS and
    every streamed count s with ceil(s / m) = r, CPU and streamed blocks each split evenly over the pairs."""
    if not hybrid_applies(hw, w):
        return []
    L = a.num_layers
    block_bytes = max(u.stored_bytes for u in a.units if u.kind == "block")
    out, memo = [], {}
    # k0 below fits the ring beside the resident part. With KV offloaded and one sequence the streamed blocks' KV
    # is host memory wherever they are, so k0 is exact; without offload, or serving several sequences (each slot
    # cache keeps two pages of every GPU-cache layer in VRAM), their KV takes VRAM: fewer resident units.
    exact = w.kv_offload and w.batch == 1
    for r in range(1, L):
        ring = r * block_bytes
        k0 = next((k for k in range(r + 2, L + 2) if _fits_with_ring(a, hw, w, k, r, ring)), None)
        if k0 is None:
            continue
        for m in range(1, MAX_PAIRS + 1):
            for s in range(max(m, (r - 1) * m + 1), r * m + 1):
                for k in range(k0, k0 + 1 if exact else L + 2):
                    if k - 1 - s < m:
                        break
                    pairs = tuple(zip(even_split(k - 1 - s, m), even_split(s, m)))
                    e = evaluate_layout(a, hw, w, k, pairs, cpu_rates, gpu_rates, memo=memo)
                    out.append(e)
                    if e.candidate.feasible:
                        break
    return out


def choose_layout(layouts: list[HybridEval], batch: int = 1) -> HybridEval | None:
    """The layout the plan takes of the best per pair count: the fastest; serving several sequences (where a pair
    costs two batched stage calls and their attention loops), the fewest pairs within PAIR_TIE_SHARE of it."""
    if not layouts:
        return None
    fastest = min(e.candidate.t_plan_ms for e in layouts)
    near = [e for e in layouts if e.candidate.t_plan_ms <= fastest * (1 + (PAIR_TIE_SHARE if batch > 1 else 0))]
    return min(near, key=lambda e: (e.candidate.pairs, e.candidate.t_plan_ms))


def best_per_pair_count(evals: list[HybridEval]) -> list[HybridEval]:
    """The fastest feasible layout for each pair count, in order of pair count (what the plan keeps)."""
    best: dict[int, HybridEval] = {}
    for e in evals:
        c = e.candidate
        if c.feasible and (c.pairs not in best or c.t_plan_ms < best[c.pairs].candidate.t_plan_ms):
            best[c.pairs] = e
    return [best[m] for m in sorted(best)]


def forced_layout(p: Plan, spec: ModelSpec, pairs: tuple[tuple[int, int], ...]) -> Plan:
    """`p` with the given hybrid layout instead of the searched one (tests and device checks: the search puts a
    tiny model wholly on the GPU): host units = the embedding and the `pairs` (CPU blocks, streamed blocks), the
    other blocks and the head on the GPU; no candidates and no predicted hybrid times (the layout is given, not
    chosen); prefill streams every host block to the GPU, as a searched split's does."""
    if not pairs or any(c < 1 or s < 1 for c, s in pairs) or sum(c + s for c, s in pairs) > spec.num_layers:
        raise HelmcError(f"forced hybrid layout: expected pairs of >= 1 CPU and >= 1 streamed blocks within "
                         f"{spec.num_layers} blocks, found {pairs}")
    a = analyze_program(spec)
    groups, first = [], 0
    for c, s in pairs:
        groups += [PlanGroup("cpu", first, c, a.stage(first + 1, first + 1 + c).stored_bytes),
                   PlanGroup("streamed", first + c, s, a.stage(first + 1 + c, first + 1 + c + s).stored_bytes)]
        first += c + s
    return forced_split(p, spec, first + 1).replace(
        groups=tuple(groups), t_cpu_ms=0.0, t_copy_ms=0.0, t_plan_ms=p.predictions.t_gpu_ms + p.predictions.t_comm_ms,
        staging_ring_bytes=max(g.weight_bytes for g in groups[1::2]))


def forced_split(p: Plan, spec: ModelSpec, cpu_units: int) -> Plan:
    """`p` as the plain split cpu(cpu_units) -> cuda(rest), its host blocks' prefill streamed to the GPU (what a
    searched split of a model this size would do): the reference a forced hybrid layout is compared with."""
    a = analyze_program(spec)
    block = max(u.stored_bytes for u in a.units if u.kind == "block")
    host_blocks = 0 < cpu_units - 1 and cpu_units < a.num_units
    return p.replace(cpu_units=cpu_units, candidates=(), hybrid_candidates=(), groups=(), staging_ring_bytes=0,
                     t_copy_ms=0.0, prefill_on_gpu=host_blocks, prefill_staging_bytes=block if host_blocks else 0)
