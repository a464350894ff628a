"""Calibrate the cost model's overheads on helmc's own decode step (thesis 6.4.4: T_hat = T_pred + N delta).

    r = calibrate("bundle/", "hardware.json", weights_dir="model/")   # times the real stages here
    r.profile.save("calibrated.json")                                 # per-device deltas, source "calibrated"
    predict_bundle(spec, plan, r.profile).t_plan_ms                   # T_plan of that bundle's split

For every device the bundle's plan puts blocks on, runtime.calibrate times decode steps through
that device's compiled stage; the fitted delta is what a block took beyond the cost model's
roofline for it at the same mean decode context:

    delta_dev = (t_step_dev - T_roofline(blocks_dev)) / blocks_dev
    sigma_dev = t_tail_dev - T_roofline(head on dev) [- T_comm of one crossing, on the GPU]

sigma is the step's tail beyond the head's roofline (embedding gather, RoPE, logits out, sampling
and, on the GPU, the crossing as the runtime makes it), charged where the lm_head runs. Both go
into the device's part of a new profile; the rates themselves (bandwidths, FLOP rates) are the
given profile's, so the deltas make that profile predict this machine.

A mixture-of-experts bundle's routing is counted too, over a calibration prompt run through the whole model
(runtime/moe_routing.py), and stored in the bundle (expert_stats.json) with its plan made again from them (the hottest
experts in VRAM), for an unsigned bundle.

Imports no TVM compiler (the measuring half is runtime.calibrate; the model half is pure Python),
so this runs on the target with TVM_USE_RUNTIME_LIB=1.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from helmc.planner.analyze_program import ProgramAnalysis, analyze_program
from helmc.planner.budget import budgeted
from helmc.planner.cost_model import DeviceRates, Workload, comm_time_ms, stage_time
from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile, load_hardware
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Candidate, Plan

if TYPE_CHECKING:
    from helmc.runtime.measure_bundle import BundleTimings

SOURCE = "calibrated"


@dataclass(frozen=True)
class DeviceFit:
    """One device's measurement beside the cost model, at the plan's mean decode context."""
    device: str                       # "cpu" | "gpu"
    blocks: int = 0                   # blocks per timed step (0: the plan has none here)
    distinct_blocks: int = 0
    measured_step_ms: float = 0.0     # p50 of one decode step through `blocks`
    roofline_step_ms: float = 0.0     # the cost model for those blocks with delta = 0
    measured_tail_ms: float = 0.0     # p50 of the step's tail (0: the lm_head is not here)
    modelled_tail_ms: float = 0.0     # head roofline (+ one crossing's T_comm on the GPU)
    crossing_ms: float = 0.0          # GPU: hidden state + RoPE rows host -> device, synchronised
    has_tail: bool = False
    block_bytes: int = 0              # weight bytes of one of the blocks (0: not known)
    overhead_block_bytes: int = 0     # the cost model's weight bytes per timed block (what delta is charged per)

    @property
    def read_gbs(self) -> float:
        """The blocks' weight bytes over the measured step: what the stage read, all its work counted (0: unknown)."""
        return self.block_bytes * self.blocks / self.measured_step_ms / 1e6 if self.block_bytes and self.blocks else 0.0

    @property
    def block_overhead_ms(self) -> float:
        return (self.measured_step_ms - self.roofline_step_ms) / self.blocks if self.blocks else math.nan

    @property
    def step_overhead_ms(self) -> float:
        return self.measured_tail_ms - self.modelled_tail_ms if self.has_tail else math.nan

    def to_json_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.blocks:
            out["block_overhead_ms"] = self.block_overhead_ms
            out["measured_block_ms"] = self.measured_step_ms / self.blocks
            out["roofline_block_ms"] = self.roofline_step_ms / self.blocks
        if self.has_tail:
            out["step_overhead_ms"] = self.step_overhead_ms
        return out


@dataclass(frozen=True)
class CalibrationResult:
    profile: HardwareProfile
    fits: tuple[DeviceFit, ...]
    bundles: tuple[str, ...]
    steps: int
    mean_context: float
    routing: tuple[str, ...] = ()     # a line per mixture-of-experts bundle: its routing statistics measured, stored

    def to_json_dict(self) -> dict:
        return {"bundles": list(self.bundles), "steps": self.steps, "mean_context": self.mean_context,
                "routing": list(self.routing),
                "fits": [f.to_json_dict() for f in self.fits],
                "cpu_block_overhead_ms": self.profile.cpu.block_overhead_ms,
                "cpu_step_overhead_ms": self.profile.cpu.step_overhead_ms,
                "gpu_block_overhead_ms": self.profile.gpu.block_overhead_ms if self.profile.gpu else None,
                "gpu_step_overhead_ms": self.profile.gpu.step_overhead_ms if self.profile.gpu else None}

    def summary(self) -> str:
        lines = [f"calibrated on {', '.join(self.bundles)}: {self.steps} decode steps per part, "
                 f"mean context {self.mean_context:g} tokens"]
        for f in self.fits:
            name = f.device.upper()
            if f.blocks:
                lines.append(f"  {name} blocks: {f.measured_step_ms / f.blocks:.4f} ms/block measured "
                             f"({f.blocks} per step, {f.distinct_blocks} distinct), roofline "
                             f"{f.roofline_step_ms / f.blocks:.4f} -> delta {f.block_overhead_ms:+.4f} ms")
            if f.has_tail:
                extra = f", crossing {f.crossing_ms:.4f} ms of it" if f.device == "gpu" else ""
                lines.append(f"  {name} step tail (embedding, RoPE, head, logits out, sampling{extra}): "
                             f"{f.measured_tail_ms:.4f} ms measured, modelled {f.modelled_tail_ms:.4f} "
                             f"-> sigma {f.step_overhead_ms:+.4f} ms")
        lines += [f"  {r}" for r in self.routing]
        return "\n".join(lines)


def decode_workload(plan: Plan) -> Workload:
    """The workload a bundle's plan was made for, scored as decode."""
    pl, wl = plan.placement, plan.workload
    return Workload(prompt_len=wl.prompt_len, output_len=wl.output_len, batch=wl.batch, objective="decode",
                    kv_offload=wl.kv_offload, hybrid=pl.is_hybrid)


def predict_bundle(spec: ModelSpec, plan: Plan, hw: HardwareProfile, prompt_len: int | None = None,
                   output_len: int | None = None) -> Candidate:
    """The cost model's row for this bundle's split on `hw` (e.g. a calibrated profile): t_cpu_ms,
    t_gpu_ms, t_comm_ms and t_plan_ms per decode token at the plan's workload, or at prompt_len /
    output_len where given (a benchmark's requests, which need not be what the plan was made for).
    Pure Python."""
    pl = plan.placement
    from helmc.planner.search_partition import evaluate_split

    a = analyze_program(spec)
    if a.num_layers != pl.num_layers:
        raise HelmcError(f"predict: plan expected for {a.num_layers} blocks, found {pl.num_layers}")
    if pl.uses_gpu and hw.gpu is None:
        raise HelmcError(f"predict: the plan {plan.describe()} uses a GPU, the hardware profile has none")
    hw = budgeted(hw, made_for=plan)
    cpu = DeviceRates.of_device(hw, "cpu", analysis=a)
    gpu = DeviceRates.of_device(hw, "gpu", analysis=a) if hw.gpu is not None else None
    w = decode_workload(plan)
    w = dataclasses.replace(w, prompt_len=prompt_len or w.prompt_len, output_len=output_len or w.output_len)
    if pl.is_hybrid:
        return _predict_hybrid(a, hw, w, plan, cpu, gpu)
    cand, _ = evaluate_split(a, hw, w, pl.cpu_units, cpu, gpu)
    return cand


def _predict_hybrid(a: ProgramAnalysis, hw: HardwareProfile, w: Workload, plan: Plan, cpu: DeviceRates,
                    gpu: DeviceRates) -> Candidate:
    """A hybrid plan's own layout and ring scored on `hw`, as a Candidate row of its split."""
    pl, mem = plan.placement, plan.memory
    from helmc.planner.hybrid import evaluate_layout
    if hw.link is None or not hw.link.has_concurrent:
        raise HelmcError(f"predict: the plan {plan.describe()} streams blocks during decode; the hardware profile "
                         f"expected the DRAM + PCIe concurrent rates, found none (measure them with helmc profile)")
    pairs = tuple((c.num_layers, s.num_layers) for c, s in zip(pl.groups[::2], pl.groups[1::2]))
    h = evaluate_layout(a, hw, w, pl.cpu_units, pairs, cpu, gpu, ring_bytes=mem.staging_ring_bytes).candidate
    return Candidate(cpu_units=h.cpu_units, gpu_units=a.num_units - h.cpu_units, t_cpu_ms=h.t_cpu_ms,
                     t_gpu_ms=h.t_gpu_ms, t_comm_ms=h.t_comm_ms, t_plan_ms=h.t_plan_ms, gpu_bytes=h.gpu_bytes,
                     cpu_bytes=h.cpu_bytes, feasible=h.feasible, why=h.why, max_context=h.max_context)


def fit_device(a: ProgramAnalysis, hw: HardwareProfile, w: Workload, device: str, stage=None, tail=None) -> DeviceFit:
    """Set a device's measured stage and tail (runtime.calibrate timings) beside the bare roofline."""
    rates = DeviceRates.of_device(hw, device, with_overheads=False, analysis=a)
    blend = device == "cpu"
    fit = DeviceFit(device=device)
    if stage is not None:
        load = a.stage(1, 1 + stage.blocks)                            # `blocks` blocks, nothing else
        roof = stage_time(a, load, rates, w, blend_l3=blend).total_ms
        fit = dataclasses.replace(fit, blocks=stage.blocks, distinct_blocks=stage.distinct_blocks,
                                  measured_step_ms=stage.p50_ms, roofline_step_ms=roof,
                                  overhead_block_bytes=load.block_param_bytes // stage.blocks)
    if tail is not None:
        n = a.num_units
        modelled = stage_time(a, a.stage(n - 1, n), rates, w, blend_l3=blend).total_ms
        if device == "gpu":
            modelled += comm_time_ms(a, 1, w, hw.link)                 # the link model of the crossing it holds
        fit = dataclasses.replace(fit, measured_tail_ms=tail.p50_ms, modelled_tail_ms=modelled,
                                  crossing_ms=tail.crossing_p50_ms, has_tail=True)
    return fit


def apply_fits(hw: HardwareProfile, fits: list[DeviceFit], note: str, source: str = "calibrated") -> HardwareProfile:
    """hw with each fitted device's delta / sigma set (others unchanged), its source `source`."""
    devices = {"cpu": hw.cpu, "gpu": hw.gpu}
    for f in fits:
        changes = {}
        if f.blocks:
            changes["block_overhead_ms"] = round(f.block_overhead_ms, 5)
        if f.device == "cpu" and f.read_gbs:
            changes["stage_read_gbs"] = round(f.read_gbs, 2)
        if f.device == "cpu" and f.blocks:
            changes["overhead_block_bytes"] = f.overhead_block_bytes
        if f.has_tail:
            changes["step_overhead_ms"] = round(f.step_overhead_ms, 5)
        devices[f.device] = dataclasses.replace(devices[f.device], **changes)
    origin = () if hw.source in (SOURCE, source) else (
        f"calibrate: the rates are those of a profile whose source was {hw.source!r}",)
    return dataclasses.replace(hw, cpu=devices["cpu"], gpu=devices["gpu"], source=source,
                               notes=tuple(hw.notes) + origin + (note,))


def calibrate(bundle_dirs: "str | list[str]", hardware: "str | HardwareProfile", weights_dir: str | None = None,
              steps: int | None = None, warmup: int = 5, trusted_keys: tuple | None = None,
              require_signed: bool = False) -> CalibrationResult:
    """Time the decode step of one or more bundles on this machine and fit each device's delta and
    sigma against `hardware`. With several bundles each part (a device's blocks, the head's
    device) is timed on the first bundle whose plan has it, so one profile serves them all.
    trusted_keys, require_signed: as Session.load (each bundle's signature checked before it is read)."""
    from helmc.runtime.measure_bundle import load_bundle_parts, measure_bundle, plan_parts

    bundles = [bundle_dirs] if isinstance(bundle_dirs, str) else list(bundle_dirs)
    if not bundles:
        raise HelmcError("calibrate: expected at least one bundle directory, found none")
    hw = load_hardware(hardware)
    done: set[str] = set()
    fits: dict[str, DeviceFit] = {}
    used, mean_context, n_steps = [], 0.0, 0
    for bundle in bundles:
        spec, plan, _, _ = load_bundle_parts(bundle, weights_dir, trusted_keys, require_signed)
        todo = tuple(p for p in plan_parts(plan) if p not in done)
        if spec.moe is not None:
            # a mixture of experts' GPU blocks wait on the host's experts every step: measure_bundle times dense GPU
            # blocks alone, so only the routing and the CPU's expert sum (below) are measured for them
            todo = tuple(p for p in todo if p != "gpu_blocks")
        if not todo:
            continue
        if any(p.startswith("gpu") for p in todo) and hw.gpu is None:
            raise HelmcError(f"calibrate: bundle {bundle} runs a GPU stage, the hardware profile has no GPU")
        t = measure_bundle(bundle, weights_dir, todo, steps=steps, warmup=warmup, cpu_cache_bytes=hw.cpu.l3_bytes,
                           trusted_keys=trusted_keys, require_signed=require_signed)
        a, w = analyze_program(t.spec), decode_workload(t.plan)
        for device in ("cpu", "gpu"):
            stage, tail = t.stage(device), t.tail(device)
            if stage is not None or tail is not None:
                fits[device] = _merge(fits.get(device), fit_device(a, hw, w, device, stage, tail))
        done.update(todo)
        used.append(bundle)
        n_steps, mean_context = t.steps, w.decode_context
    for f in fits.values():
        for value in ((f.block_overhead_ms,) if f.blocks else ()) + ((f.step_overhead_ms,) if f.has_tail else ()):
            if not math.isfinite(value):
                raise HelmcError(f"calibrate: {f.device} fit expected finite overheads, found {value}")
    parts = []
    for f in fits.values():
        if f.blocks:
            parts.append(f"{f.device} delta {f.block_overhead_ms:+.4f} ms/block")
        if f.has_tail:
            parts.append(f"{f.device} sigma {f.step_overhead_ms:+.4f} ms/token")
    note = (f"calibrate: {'; '.join(parts)}, fitted on helmc's own decode step ({', '.join(used)}; "
            f"{n_steps} steps, mean context {mean_context:g}) against this profile's rates")
    # a mixture of experts' routing: counted over a calibration prompt, stored in the bundle, its plan made again
    from helmc.runtime.moe_routing import calibrate_routing
    routing, reads, halves = (), {}, []
    for b in bundles:
        measured = calibrate_routing(b, weights_dir, trusted_keys, require_signed)
        routing += measured.lines
        reads.update({(t, n): gbs for t, n, gbs in measured.expert_sum_reads})
        halves += [measured.host_half_ms] if measured.host_half_ms is not None else []
    profile = apply_fits(hw, list(fits.values()), note)
    if halves and profile.gpu is not None:     # the GPU's wait at a routed block whose experts are partly on the host
        profile = dataclasses.replace(profile, gpu=dataclasses.replace(
            profile.gpu, moe_host_half_ms=round(statistics.median(halves), 5)))
    if reads:        # the CPU's one-call expert sum, what the cost model prices a token's host experts at
        from helmc.hardware.profile import ExpertSumRead
        kept = {(r.weight_type, r.experts): r.gbs for r in profile.cpu.expert_sum_reads}
        kept.update(reads)
        profile = dataclasses.replace(profile, cpu=dataclasses.replace(
            profile.cpu, expert_sum_reads=tuple(ExpertSumRead(t, n, g) for (t, n), g in sorted(kept.items()))))
    for b in bundles:
        routing += _place_by_routing(b, profile, trusted_keys, require_signed)
    return CalibrationResult(profile, tuple(fits.values()), tuple(used), n_steps, mean_context, routing)


def _place_by_routing(bundle_dir: str, profile, trusted_keys, require_signed) -> tuple[str, ...]:
    """A mixture-of-experts bundle whose routing statistics were just stored gets its plan made again from them and
    the calibrated profile (its hottest experts in VRAM, the CPU's share at the measured expert-sum rate), stored as
    its plan.json, so `helmc run` uses it without a --plan. A dense or signed bundle is left as it is."""
    import os

    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.bundle.expert_stats import read_expert_stats, store_expert_stats
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.runtime.bundle.signature import SIGNATURE_NAME
    if os.path.exists(os.path.join(bundle_dir, SIGNATURE_NAME)):
        return ()
    stats = read_expert_stats(bundle_dir, verify_bundle(bundle_dir, trusted_keys=trusted_keys,
                                                        require_signed=require_signed))
    if stats is None:
        return ()
    new, _ = replan_bundle(bundle_dir, profile)
    store_expert_stats(bundle_dir, stats, plan=new)
    verify_bundle(bundle_dir, trusted_keys=trusted_keys, require_signed=require_signed)
    return (f"plan made again from them: {new.describe()}, predicted expert hit rate "
            f"{new.predictions.expert_hit_rate:.2f}, {new.tokens_per_s:.1f} tok/s predicted; stored in "
            f"{os.path.join(bundle_dir, 'plan.json')}",)


_BLOCK_FIELDS = ("blocks", "distinct_blocks", "measured_step_ms", "roofline_step_ms", "overhead_block_bytes")
_TAIL_FIELDS = ("measured_tail_ms", "modelled_tail_ms", "crossing_ms", "has_tail")


def _merge(old: DeviceFit | None, new: DeviceFit) -> DeviceFit:
    """One device's fit from two bundles: each part from the bundle that timed it."""
    if old is None:
        return new
    take = (_BLOCK_FIELDS if new.blocks else ()) + (_TAIL_FIELDS if new.has_tail else ())
    return dataclasses.replace(old, **{k: getattr(new, k) for k in take})


# Rounds of the synthetic stages' timing, every round's steps pooled into one median. One round of 16 steps is half a
# second of the CPU stage, and a host's bandwidth drops in bursts of about that (host_read.py): one GPU-machine host
# timed the same synthetic stage three times in a minute at 55-93 GB/s where the real split's CPU stage read 82-83
# (a 64-token run each), and a one-round profile of another host read 11% above the split's stage in the bench beside it.
SYNTHETIC_ROUNDS = 3


def synthetic_fits(hw: HardwareProfile, kit_dir: str, steps: int = 16, warmup: int = 3,
                   progress=lambda m: None, rounds: int = SYNTHETIC_ROUNDS
                   ) -> tuple[list[DeviceFit], str, tuple[str, ...]]:
    """(fits, note, unmeasured) of `helmc profile`'s per-device delta and sigma: calibrate's fit on the profile kit's
    synthetic bundles (helmc's compiled CPU stage, and GPU stage where the kit has one for this GPU), with random
    weights written for the blocks a timed step binds, against hw's rates. Each bundle is timed in `rounds` rounds,
    the bundles taking turns, and each device's fit is over the median of every round's steps."""
    import tempfile

    from helmc.hardware.kit import ProfileKit, write_synthetic_weights
    from helmc.runtime.measure_bundle import distinct_blocks, measure_bundle

    kit = ProfileKit.load(kit_dir)
    if not kit.cpu_bundle:
        raise HelmcError(f"profile: the kit in {kit_dir} has no compiled stages (built with stages=False); expected "
                         f"a kit from `helmc profile --build-kit`")
    bundles = [os.path.join(kit_dir, kit.cpu_bundle)]
    skipped = ()
    if kit.gpu_bundle and hw.gpu is not None and hw.gpu.arch == kit.gpu_arch:
        bundles.append(os.path.join(kit_dir, kit.gpu_bundle))
    elif hw.gpu is not None:
        skipped = (f"gpu.block_overhead_ms, gpu.step_overhead_ms: the kit has no GPU stage for {hw.gpu.arch} "
                   f"(found {kit.gpu_arch or 'none'})",)
    spec = ModelSpec.from_hf_config(kit.block.hf_config(kit.synthetic_layers), "synthetic model")
    block = spec.block_weight_bytes(0)
    # Four times the L3 of distinct weights per step, as the GEMV reads it is compared with (measure.py: copies
    # >= 4x L3). Twice the L3 (calibrate's rule) left part of the synthetic blocks in the GPU machine's 300 MiB L3
    # (measured: the stage read 135.6 GB/s where the GEMVs read 106.3), and the fit came out at -0.79 ms/block.
    cache = 2 * hw.cpu.l3_bytes
    layers = max(2, distinct_blocks(kit.synthetic_layers, cache, block, kit.synthetic_layers))
    fits, used, w = [], [], None
    with tempfile.TemporaryDirectory(prefix="helmc-synthetic-weights-") as weights:
        progress(f"overheads: writing {layers} synthetic blocks of {kit.block.hidden}x{kit.block.ffn} "
                 f"({layers * block >> 20} MiB)")
        write_synthetic_weights(weights, kit.block, layers)
        timed = {bundle: [] for bundle in bundles}
        for r in range(rounds):
            for bundle in bundles:
                progress(f"overheads: {steps} decode steps through {os.path.basename(bundle)} ({kit.synthetic_layers} "
                         f"blocks), round {r + 1} of {rounds}")
                timed[bundle].append(measure_bundle(bundle, weights, steps=steps, warmup=warmup, cpu_cache_bytes=cache))
        for bundle, runs in timed.items():
            t = pool_rounds(runs)
            a, w = analyze_program(t.spec), decode_workload(t.plan)
            for device in ("cpu", "gpu"):
                stage, tail = t.stage(device), t.tail(device)
                if stage is not None or tail is not None:
                    fits.append(dataclasses.replace(fit_device(a, hw, w, device, stage, tail), block_bytes=block))
            used.append(os.path.basename(bundle))
    parts = [f"{f.device} delta {f.block_overhead_ms:+.4f} ms/block (measured {f.measured_step_ms / f.blocks:.4f}, "
             f"roofline {f.roofline_step_ms / f.blocks:.4f}; the blocks' weights read at {f.read_gbs:.1f} GB/s), "
             f"sigma {f.step_overhead_ms:+.4f} ms/token" for f in fits]
    note = (f"overheads: {'; '.join(parts)}: helmc's compiled stages ({', '.join(used)}) on a synthetic "
            f"{kit.block.hidden}x{kit.block.ffn} Qwen3 block, {rounds} rounds of {steps} steps at mean context {w.decode_context:g}, "
            f"against this profile's rates (helmc calibrate refines them on a real bundle)")
    return fits, note, skipped


def clamp_negative_deltas(hw: HardwareProfile) -> HardwareProfile:
    """hw with negative per-block deltas set to 0, said in a note. On the machine that measured the rates, a stage
    faster than their roofline is a measurement artefact (cache hits, a bandwidth figure from a slow minute), not a
    negative cost: the planner would promise a block for less than its bytes take to read. (calibrate on a real
    bundle keeps negative deltas: its profile may come from another machine.)"""
    clamped, said = {}, []
    for name in ("cpu", "gpu"):
        device = getattr(hw, name)
        for field in ("block_overhead_ms", "step_overhead_ms"):   # sigma too: a busy host's tail fit goes below 0
            value = getattr(device, field, None) if device is not None else None
            if value is not None and value < 0:
                device = clamped[name] = dataclasses.replace(device, **{field: 0.0})
                said.append(f"{name} {'delta' if field == 'block_overhead_ms' else 'sigma'}")
    if not clamped:
        return hw
    return dataclasses.replace(hw, **clamped, notes=tuple(hw.notes) + (
        f"overheads: the {' and '.join(said)} below 0 set to 0 (the synthetic stage ran faster than the "
        f"profile's own rates)",))


def pool_rounds(runs: "list[BundleTimings]") -> "BundleTimings":
    """One bundle's timings of several rounds as one: every stage's and tail's samples in round order."""
    first = runs[0]
    for t in runs[1:]:
        if ([(s.device, s.blocks, s.distinct_blocks) for s in t.stages] !=
                [(s.device, s.blocks, s.distinct_blocks) for s in first.stages] or
                [x.device for x in t.tails] != [x.device for x in first.tails]):
            raise HelmcError(f"calibrate: the rounds of {first.bundle_dir} timed different parts; expected the same "
                             f"stages and tails in every round")
    stages = tuple(dataclasses.replace(s, step_ms=tuple(x for t in runs for x in t.stages[i].step_ms))
                   for i, s in enumerate(first.stages))
    tails = tuple(dataclasses.replace(x, tail_ms=tuple(v for t in runs for v in t.tails[i].tail_ms),
                                      crossing_ms=tuple(v for t in runs for v in t.tails[i].crossing_ms))
                  for i, x in enumerate(first.tails))
    return dataclasses.replace(first, stages=stages, tails=tails, steps=sum(t.steps for t in runs))


def synthetic_overheads(hw: HardwareProfile, kit_dir: str, steps: int = 16, warmup: int = 3,
                        progress=lambda m: None, rounds: int = SYNTHETIC_ROUNDS) -> HardwareProfile:
    """hw with each device's delta and sigma from synthetic_fits; the rates are hw's own, its source unchanged."""
    fits, note, skipped = synthetic_fits(hw, kit_dir, steps, warmup, progress, rounds)
    out = apply_fits(hw, fits, note, source=hw.source)
    out = clamp_negative_deltas(out)
    return dataclasses.replace(out, unmeasured=out.unmeasured + skipped)
