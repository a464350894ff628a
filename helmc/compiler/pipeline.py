"""The build pipeline, every phase in order (mlc-llm style: one file lists them all).

  1. read_model      config.json or a GGUF header -> ModelSpec (weights bind at run time; `--quant` quantizes
                     a Hugging Face checkpoint once into the weights cache)
  2. search_plan     ModelSpec x HardwareProfile -> Plan (thesis Algorithm 1)
  3. export_onnx     pre_attn / post_attn / head through torch.onnx.export(dynamo=True)
  4. import_relax    ONNX -> one Relax IRModule (prefill, decode and batched decode variants)
  5. compile_cpu     LLVM for the profile's CPU features          (cached)
  6. compile_gpu     CUDA for the profile's GPU arch, to cubin     (cached; only if the plan uses a GPU)
  7. write_bundle    libraries, plan, spec, tokenizer, manifest with sha256 of every file

Compile cost does not grow with depth: one block function per device serves every layer.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from helmc.compiler.artifact_cache import ArtifactCache, cache_key, tvm_version
from helmc.compiler.frame_modules import frames_of_no_module_remembered
from helmc.compiler.options import BuildOptions, build_options
from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan
from helmc.runtime.progress import Progress

CPU_LIB = "cpu_stage.so"


@dataclass(frozen=True)
class BuildResult:
    bundle_dir: str
    spec: ModelSpec
    plan: Plan
    cache_hits: tuple[str, ...]
    seconds: float


def read_config(model_dir: str) -> tuple[ModelSpec, str]:
    from helmc.compiler.read_model import read_model
    source = read_model(model_dir)
    return source.spec, source.config_sha256


# Hybrid decode (planner/hybrid.py): runtime/hybrid/ executes a plan's streamed groups (the staging ring, its
# copies on their own stream, the crossings), so a build takes a hybrid layout where the search predicts it faster.
BUILD_HYBRID = True


def hybrid_allowed(hybrid: bool, stream_prefill: bool, batch: int) -> bool:
    """Whether a build searches hybrid layouts: asked for (BUILD_HYBRID, `--hybrid`), with the host blocks' prefill
    streamed to the GPU (runtime/hybrid keeps today's streamed prefill and refuses a plan without it). Any batch:
    serving several sequences runs the schedule's batched twin (runtime/hybrid/batch.py)."""
    assert batch >= 1, batch
    return BUILD_HYBRID and hybrid and stream_prefill


def search_plan(spec: ModelSpec, hw: HardwareProfile, prompt_len: int, output_len: int,
                stream_prefill: bool = True, batch: int = 1, hybrid: bool = True, expert_stats=None) -> Plan:
    from helmc.planner.search_partition import plan as search
    return search(spec, hw, prompt_len=prompt_len, output_len=output_len, stream_prefill=stream_prefill, batch=batch,
                  hybrid=hybrid_allowed(hybrid, stream_prefill, batch), expert_stats=expert_stats)


def cpu_target(hw: HardwareProfile) -> tuple[str, tuple[str, ...]]:
    """(LLVM target description, CPU features the compiled code requires)."""
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target, required_cpu_features
    target = llvm_target(hw.cpu.features)
    return json.dumps(dict(target.export()), sort_keys=True, default=str), tuple(required_cpu_features(hw.cpu.features))


def compile_cpu(mod, hw: HardwareProfile, out_path: str, spec: ModelSpec | None = None,
                prefill_activations: str = "model"):
    from helmc.compiler.passes.schedule_cpu_stage import compile_cpu_stage
    # spec: adds the decode-attention kernel
    exe = compile_cpu_stage(mod, hw.cpu.features, spec, hw.cpu.cores, prefill_activations)
    exe.export_library(out_path)


def compile_gpu(mod, hw: HardwareProfile, out_dir: str, spec: ModelSpec) -> tuple[str, ...]:
    """The GPU stage's library and cubins, and the paged decode attention kernels for its KV pages."""
    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage, compile_paged_attention
    from helmc.compiler.passes.quantize_functions import quantize_functions
    mod, weight_types = quantize_functions(mod, spec)
    stage = compile_gpu_stage(mod, hw.gpu.arch, out_dir, name="gpu_stage", weight_types=weight_types,
                              kernels=gpu_moe_kernels(spec))
    return stage + (compile_paged_attention(spec.head_dim, spec.group_size, hw.gpu.arch, out_dir),)


def gpu_moe_kernels(spec: ModelSpec) -> dict:
    """{global symbol: PrimFunc}: the GPU's two-launch decode expert kernels of each routed expert type signature,
    for the experts the plan keeps in VRAM: schedules/gpu/moe_experts.py's over int8 GPU kernels for plain SwiGLU
    experts, moe_experts_biased.py's for gpt-oss's biased, clamped ones; the runtime looks them up by name and runs
    the expert function per expert where they are absent."""
    if spec.moe is None or not (spec.moe.plain_experts or spec.moe.biased_experts):
        return {}
    from helmc.schedules.gpu.moe_experts import gpu_moe_applies, make_gpu_moe_kernels, make_gpu_moe_rows_kernels
    from helmc.schedules.gpu.moe_experts_biased import gpu_moe_biased_applies, make_gpu_moe_biased_kernels
    moe, out = spec.moe, {}
    E, I, H = moe.num_experts, moe.expert_intermediate_size, spec.hidden_size
    for gate, up, down in spec.expert_signatures():
        if gate != up:
            continue
        if moe.biased_experts and gpu_moe_biased_applies(gate, down, E, I, H):
            for rows in (False, True):          # one decode row; a batched step's rows
                out.update(make_gpu_moe_biased_kernels(gate, down, E, I, H, moe.top_k, moe.swiglu_alpha,
                                                       moe.swiglu_limit, rows=rows))
        elif moe.plain_experts and gpu_moe_applies(gate, down, I, H):
            out.update(make_gpu_moe_kernels(gate, down, E, I, H, moe.top_k))
            out.update(make_gpu_moe_rows_kernels(gate, down, E, I, H))      # a batched step's rows
    return out


def check_placement(spec: ModelSpec, plan: Plan, hardware: HardwareProfile) -> None:
    """A plan this build can carry out: a GPU where it places units; for a mixture-of-experts model, no streamed
    prefill or hybrid decode (their staging holds dense blocks): its GPU blocks run attention and the router on
    the GPU and the routed experts on the CPU (runtime/moe_gpu.py)."""
    if plan.placement.uses_gpu and hardware.gpu is None:
        raise HelmcError("plan uses a GPU but the hardware profile has none")
    if spec.moe is not None and (plan.placement.prefill_on_gpu or plan.placement.groups):
        raise HelmcError(f"plan: a mixture-of-experts model ({spec.architecture}) expected a plain CPU/GPU split, found "
                         f"{plan.describe()}"
                         f"{' with its prefill streamed to the GPU' if plan.placement.prefill_on_gpu else ''}")


def _compile_jobs(spec, hardware: HardwareProfile, o: BuildOptions, batches, llvm_desc: str, need_cpu: bool,
                  need_gpu: bool) -> dict[str, str]:
    """The artifact cache key of each stage library the build needs ("cpu", "gpu")."""
    batch_key = f"|batch={','.join(map(str, batches))}" if batches else ""
    jobs = {}
    if need_cpu:
        # cores set the kernels' parallel split counts, so they are part of what the library was made for
        jobs["cpu"] = cache_key(spec.architecture_hash(), "cpu",
                                f"{llvm_desc}|cores={hardware.cpu.cores}|prefill={o.prefill_activations}{batch_key}")
    if need_gpu:
        jobs["gpu"] = cache_key(spec.architecture_hash(), "gpu", hardware.gpu.arch + batch_key)
    return jobs


def _cached(cache, jobs: dict[str, str], progress) -> dict:
    """Each job's cached artifact directory, or None to compile (a corrupt entry warned about and removed)."""
    hits = {stage: cache.lookup(key) for stage, key in jobs.items()}
    for stage, key in jobs.items():
        if key in cache.corrupt:
            # a warning, not progress: said on stderr whether or not it is a terminal
            print(f"helmc: warning: compile_{stage}: cached artifacts {key} corrupt (a file missing or changed since "
                  "it was stored); removed, rebuilding", file=sys.stderr)
    for stage, d in hits.items():
        if d:
            progress(f"compile_{stage}: reusing cached artifacts {os.path.relpath(d)}")
    return hits


def _compile_missing(spec, hardware: HardwareProfile, o: BuildOptions, cache, jobs, hits: dict, batches,
                     llvm_desc: str, work: str, progress) -> None:
    """Export, import and compile each stage library not in the cache, in `work`; store it and record it in hits."""
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    if "cpu" in jobs and not hits["cpu"]:
        mod = import_functions(export_functions(spec, act_dtype="float32"), batches)
        progress("export_onnx: pre_attn, post_attn, head exported (symbolic seq, float32 activations)")
        progress(f"import_relax: {len(mod.functions)} functions (prefill, decode"
                 f"{', batched decode for ' + '/'.join(map(str, batches)) + ' sequences' if batches else ''})")
        lib = os.path.join(work, CPU_LIB)
        compile_cpu(mod, hardware, lib, spec, o.prefill_activations)
        hits["cpu"] = cache.store(jobs["cpu"], {CPU_LIB: lib}, {"llvm_target": llvm_desc, "model": spec.architecture_hash()})
        progress(f"compile_cpu: {CPU_LIB} ({os.path.getsize(lib) // 1024} KiB) for {llvm_desc}")
    if "gpu" in jobs and not hits["gpu"]:
        mod = import_functions(export_functions(spec, act_dtype="float16"), batches)
        progress("export_onnx: pre_attn, post_attn, head exported (symbolic seq, float16 activations)")
        gdir = os.path.join(work, "gpu")
        os.makedirs(gdir)
        names = compile_gpu(mod, hardware, gdir, spec)
        hits["gpu"] = cache.store(jobs["gpu"], {n: os.path.join(gdir, n) for n in names},
                                  {"arch": hardware.gpu.arch, "files": list(names)})
        progress(f"compile_gpu: {', '.join(names)} for {hardware.gpu.arch}")


def _libraries(hits: dict, need_cpu: bool, need_gpu: bool) -> list[tuple[str, str]]:
    """(name in the bundle, path) of every stage library file, from the cache."""
    libraries = []
    if need_cpu:
        libraries.append((CPU_LIB, os.path.join(hits["cpu"], CPU_LIB)))
    if need_gpu:
        with open(os.path.join(hits["gpu"], "meta.json")) as f:
            for n in json.load(f)["files"]:
                libraries.append((n, os.path.join(hits["gpu"], n)))
    return libraries


def build(model_dir: str, hardware: HardwareProfile, out_dir: str, options: BuildOptions | None = None, *,
          plan: Plan | None = None, signer=None, **keywords) -> BuildResult:
    """options: a BuildOptions, or its fields as keywords. plan: this plan instead of the search's.
    signer: an ed25519 private key (signature.load_private_key) to sign the manifest with, or None."""
    o = build_options(options, keywords)
    progress = Progress(o.quiet)
    from helmc.compiler.passes.lower_linear import check_prefill_activations
    from helmc.compiler.read_model import read_model
    from helmc.compiler.write_bundle import BundleInputs, write_bundle
    check_prefill_activations(o.prefill_activations)

    weights_cache = os.path.join(o.cache_dir, "weights") if o.cache_dir else None
    source = read_model(model_dir, o.quant, weights_cache, progress=progress)
    spec, config_sha = source.spec, source.config_sha256
    types = "/".join(dict.fromkeys(t or spec.dtype for sig in spec.block_signatures() for t in sig))
    progress(f"read_model: {spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
             f"{'weights ' + types if spec.quantized else spec.dtype}")
    searched = plan is None
    plan = plan or search_plan(spec, hardware, o.prompt_len, o.output_len, o.stream_prefill, o.batch, o.hybrid)
    progress(f"search_plan: {plan.describe()}, predicted {plan.predictions.t_plan_ms:.1f} ms/token, max context "
             f"{plan.memory.max_context}")

    check_placement(spec, plan, hardware)
    # a mixture of experts' routed experts run on the CPU stage wherever their block is
    need_cpu = bool(len(plan.placement.cpu_layers)) or not plan.placement.head_on_gpu or spec.moe is not None
    need_gpu = plan.placement.uses_gpu
    cache = ArtifactCache(o.cache_dir, enabled=o.use_cache)
    from helmc.runtime.stage import decode_batch_sizes
    batches = decode_batch_sizes(plan.workload.batch)        # the batched decode variants: part of what a library holds
    llvm_desc, cpu_required = cpu_target(hardware) if need_cpu else ("", ())
    jobs = _compile_jobs(spec, hardware, o, batches, llvm_desc, need_cpu, need_gpu)
    hits = _cached(cache, jobs, progress)
    reused = tuple(stage for stage, d in hits.items() if d)

    with tempfile.TemporaryDirectory(prefix="helmc-build-") as work:
        if not all(hits.values()):
            with frames_of_no_module_remembered():          # TVMScript's kernels parse without rescans
                _compile_missing(spec, hardware, o, cache, jobs, hits, batches, llvm_desc, work, progress)
        libraries = _libraries(hits, need_cpu, need_gpu)
        write_bundle(BundleInputs(
            out_dir=out_dir, spec=spec, plan=plan, hardware=hardware, weights=source.weights,
            tokenizer_dir=source.tokenizer_dir, tokenizer_json=source.tokenizer_json, chat_template=source.chat_template,
            model_config_sha256=config_sha, libraries=tuple(libraries),
            target_hash=hashlib.sha256(f"{llvm_desc}|{hardware.gpu.arch if need_gpu else ''}".encode()).hexdigest()[:16],
            cpu_features_required=cpu_required, llvm_target=llvm_desc,
            cuda_arch=hardware.gpu.arch if need_gpu else "", tvm_version=tvm_version(), copy_weights=o.copy_weights,
            prefill_activations=o.prefill_activations if need_cpu else "", signer=signer))
    progress(f"write_bundle: {out_dir}")
    from helmc.compiler.build_routing import measure_at_build, routing_is_cheap
    if searched and routing_is_cheap(spec, cpu_required, signer):     # a MoE's hottest experts in VRAM from the start
        plan = measure_at_build(out_dir, spec, plan, lambda stats: search_plan(
            spec, hardware, o.prompt_len, o.output_len, o.stream_prefill, o.batch, o.hybrid, stats))
        progress("routing statistics: counted over the calibration prompt, plan made again from them")
    return BuildResult(os.path.abspath(out_dir), spec, plan, reused, time.perf_counter() - progress.t0)
