"""A bundle's placement made again for the machine it runs on: `helmc profile` there, then
`helmc plan BUNDLE hardware.json -o plan.json` and `helmc run|serve|chat BUNDLE --plan plan.json`.

Why: a plan is only as good as the profile it was made from, and hosts of one kind differ (two H100
machines of the same class an hour apart: helmc's fp16 GEMVs read 66 and 111 GB/s, the DRAM + PCIe window held 96
and 141 GB/s). A hybrid layout made for the first host streamed one block per CPU block, bound by PCIe on the
second, where two CPU blocks per streamed one are faster. The bundle's libraries hold one block function per device
with weights as parameters, so every split and hybrid layout of its model and batch runs without compiling anything
(Session.load(plan=...)): only the placement changes. The workload is the bundle's own (prompt and output lengths,
batch, objective, KV offload), and so is the VRAM budget (its plan's usable VRAM) unless one is given. A mixture of
experts' routing statistics stored in the bundle (expert_stats.json) pick the experts held in VRAM.
Pure Python over the bundle's JSON files: this runs on the target with the runtime-only TVM.
"""
from __future__ import annotations

from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile, load_hardware
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan


def replan_bundle(bundle_dir: str, hardware: "str | HardwareProfile", gpu_budget_gib: float | None = None,
                  prompt_len: int | None = None, output_len: int | None = None, objective: str | None = None,
                  kv_offload: bool | None = None, stream_prefill: bool = True, hybrid: bool = True
                  ) -> tuple[Plan, ModelSpec]:
    """(the plan for `hardware`, the bundle's spec). Arguments left None take the bundle's plan's values; the batch
    is always the bundle's (its GPU stage and KV slots were built for it)."""
    from helmc.planner.budget import budgeted
    from helmc.planner.search_partition import plan
    from helmc.runtime.session import read_bundle
    hw = load_hardware(hardware)
    # The bundle's files as its manifest lists them, and its CPU features against the machine planned for (this
    # process loads none of its libraries: the plan may be made anywhere, for the machine `hardware` describes).
    manifest, spec, own, _ = read_bundle(bundle_dir, cpu_flags=frozenset(hw.cpu.features) if hw.cpu else None)
    hw = budgeted(hw, gpu_budget_gib, made_for=own)
    from helmc.runtime.bundle.expert_stats import read_expert_stats
    stats = read_expert_stats(bundle_dir, manifest) if spec.moe is not None else None
    made = own.workload
    p = plan(spec, hw, prompt_len=prompt_len or made.prompt_len, output_len=output_len or made.output_len,
             batch=made.batch, objective=objective or made.objective,
             kv_offload=made.kv_offload if kv_offload is None else kv_offload, stream_prefill=stream_prefill,
             hybrid=hybrid, expert_stats=stats)
    _check_code_for(p, manifest, hw, bundle_dir)
    return p, spec


def _check_code_for(p: Plan, manifest, hw: HardwareProfile, bundle_dir: str) -> None:
    """The plan's devices against the code the bundle holds: a GPU stage built for this GPU's arch, a CPU stage
    where host blocks or the head run on the CPU (an all-GPU bundle has none)."""
    from helmc.runtime.cpu_stage import CPU_STAGE_LIB
    rebuild = "rebuild the bundle with this machine's profile (helmc build MODEL hardware.json -o ...)"
    if p.placement.uses_gpu and not manifest.cuda_arch:
        raise HelmcError(f"plan: {p.describe()} uses the GPU; {bundle_dir} holds no GPU stage (built for a machine "
                         f"without one): {rebuild}")
    if p.placement.uses_gpu and hw.gpu is not None and hw.gpu.arch != manifest.cuda_arch:
        raise HelmcError(f"plan: {bundle_dir}'s GPU code is for {manifest.cuda_arch}, this GPU is {hw.gpu.arch}: "
                         f"{rebuild}")
    if (len(p.placement.cpu_layers) or not p.placement.head_on_gpu) and not manifest.lists(CPU_STAGE_LIB):
        raise HelmcError(f"plan: {p.describe()} runs blocks or the head on the CPU; {bundle_dir} holds no CPU stage "
                         f"(built to run all on the GPU): {rebuild}")
