"""The plain Python API under the CLI: profile (and build_kit), plan, build, run, calibrate, serve, chat. Each
`helmc` command parses its arguments and calls one function here. Each takes its options as one frozen dataclass
(BuildOptions, PlanOptions, RunOptions, ServeOptions, ChatOptions, CalibrateOptions; api_options.py) whose defaults are
defined once, or that dataclass's fields as keywords; a bundle's plan, weights and trusted keys are given as paths."""
from __future__ import annotations

import os
from dataclasses import dataclass

from helmc.api_options import (BUILD_DEFAULTS, PLAN_DEFAULTS, BundleOptions, CalibrateOptions, ChatOptions,
                               PlanOptions, RunOptions, ServeOptions, options_of)
from helmc.compiler.options import BuildOptions, build_options
from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile
from helmc.model.weight_types import QUANT_MIXES

__all__ = ["BUILD_DEFAULTS", "PLAN_DEFAULTS", "QUANT_CHOICES", "BuildOptions", "BundleOptions", "CalibrateOptions",
           "ChatOptions", "PlanOptions", "RunOptions", "ServeOptions", "build", "build_kit", "calibrate", "chat",
           "keygen", "plan", "plan_table", "profile", "run", "runtime_only", "serve"]

# `build`'s quant choices (the CLI's --quant): weight_types' mixes.
QUANT_CHOICES = tuple(QUANT_MIXES)


def _hardware(hardware) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    if isinstance(hardware, str):
        from helmc.hardware.profile import load_hardware
        return load_hardware(hardware)
    raise HelmcError(f"hardware: expected a HardwareProfile or a path to hardware.json, found {type(hardware).__name__}")


def profile(quick: bool = False, gpu_backend: str | None = None, kit_dir: str | None = None, overheads: bool = True,
            cache_dir: str | None = None, use_cache: bool = True, progress=None) -> HardwareProfile:
    """Measure this machine with the code helmc runs on it: the profile kit (helmc/hardware/kit.py) for this CPU's
    features and this GPU's arch, built (or taken from the artifact cache) here unless `kit_dir` gives one built
    elsewhere; then the rates (hardware/measure.py) and, with `overheads`, each device's per-block overhead on the
    kit's compiled stages (planner/calibrate.synthetic_overheads) and the VRAM the runtime holds beyond a plan
    (planner/measure_reserve.py). quick: small sizes, for tests."""
    from helmc.hardware.measure import cpu_facts, profile as measure
    from helmc.runtime.progress import Progress
    progress = progress or Progress()
    backend = gpu_backend or os.environ.get("HELMC_GPU_BACKEND")
    facts = cpu_facts()
    if kit_dir is None:
        from helmc.compiler.profile_kit import KitTarget, ensure_kit
        from helmc.hardware.measure_gpu import probe_arch
        arch, _ = probe_arch(backend)
        target = KitTarget(facts.features, facts.l3_bytes, facts.cores, arch, quick)
        kit_dir = ensure_kit(target, cache_dir=cache_dir, use_cache=use_cache, progress=progress)

    def measure_once() -> HardwareProfile:
        hw = measure(kit_dir, quick=quick, gpu_backend=backend, progress=progress, facts=facts)
        if overheads:
            from helmc.planner.calibrate import synthetic_overheads
            hw = synthetic_overheads(hw, kit_dir, steps=8 if quick else 16, progress=progress, rounds=2 if quick else 3)
        return hw
    # Rates measured while other jobs use the cores are too low: such a window is measured again, else refused.
    from helmc.hardware.host_load import measure_on_quiet_host
    hw = measure_on_quiet_host(measure_once, os.cpu_count() or facts.threads, quick=quick, progress=progress)
    if overheads:
        from helmc.planner.measure_reserve import profile_gpu_reserve
        hw = profile_gpu_reserve(hw, kit_dir, progress=progress)
    return hw


@dataclass(frozen=True)
class PlanResult:
    plan: object                        # runtime.bundle.plan.Plan
    spec: object                        # model.spec.ModelSpec

    def table(self) -> str:
        """Every candidate split as text, the chosen row marked (planner/plan_table.py)."""
        return plan_table(self.plan, self.spec)

    def to_json_dict(self) -> dict:
        """The plan and every candidate (`helmc plan --json`)."""
        from helmc.jsonio import to_dict
        pl, pr, mem = self.plan.placement, self.plan.predictions, self.plan.memory
        out = {"cpu_units": pl.cpu_units, "gpu_units": pl.gpu_units, "t_plan_ms": pr.t_plan_ms,
               "plan": self.plan.describe(), "max_context": mem.max_context,
               "candidates": [to_dict(c) for c in pr.candidates]}
        if pl.is_hybrid:
            out.update(groups=[to_dict(g) for g in pl.groups], staging_ring_bytes=mem.staging_ring_bytes,
                       t_copy_ms=pr.t_copy_ms, hybrid_candidates=[to_dict(c) for c in pr.hybrid_candidates])
        return out

    def save(self, path: str) -> None:
        """The Plan as JSON (`helmc run|serve|chat BUNDLE --plan FILE` reads it)."""
        from helmc.jsonio import atomic_write_text
        atomic_write_text(path, self.plan.to_json() + "\n")


def plan(model: str, hardware, options: PlanOptions | None = None, **keywords) -> PlanResult:
    """Which partition units run on the CPU and which on the GPU, for `model` (a Hugging Face directory or its
    config.json, a GGUF file, a ModelSpec) or a bundle (`helmc build`'s directory: planned again for `hardware`,
    with no compiling) on `hardware` (a HardwareProfile, a hardware.json path or a preset name). options: a
    PlanOptions, or its fields as keywords."""
    o = options_of(PlanOptions, options, keywords, "plan")
    if not isinstance(hardware, str):
        hardware = _hardware(hardware)
    from helmc.runtime.bundle.manifest import is_bundle_dir
    if isinstance(model, str) and is_bundle_dir(model):
        from helmc.planner.replan_bundle import replan_bundle
        if o.batch is not None or o.dtype is not None:
            raise HelmcError("plan: a bundle is planned for its own batch and weights; expected no --batch or "
                             f"--dtype, found {'--batch' if o.batch is not None else '--dtype'}")
        p, spec = replan_bundle(model, hardware, gpu_budget_gib=o.gpu_budget_gib, prompt_len=o.prompt_len,
                                output_len=o.output_len, objective=o.objective, kv_offload=o.kv_offload,
                                stream_prefill=o.stream_prefill, hybrid=o.hybrid)
        return PlanResult(p, spec)
    from helmc.planner.search_partition import load_spec, plan as search
    d = PLAN_DEFAULTS
    spec = load_spec(model)
    p = search(spec, hardware, prompt_len=o.prompt_len or d.prompt_len, output_len=o.output_len or d.output_len,
               batch=o.batch or d.batch, objective=o.objective or d.objective, gpu_budget_gib=o.gpu_budget_gib,
               kv_offload=d.kv_offload if o.kv_offload is None else o.kv_offload, dtype=o.dtype,
               stream_prefill=o.stream_prefill, hybrid=o.hybrid)
    return PlanResult(p, spec)


def plan_table(plan, spec=None) -> str:
    """A plan's candidate splits as text, the chosen row marked (what `helmc build` and `helmc plan` print)."""
    from helmc.planner.plan_table import format_plan_table
    return format_plan_table(plan, spec)


def build(model_dir: str, hardware, out_dir: str, *, gpu_budget_gib: float | None = None, sign_key: str | None = None,
          options: BuildOptions | None = None, **keywords):
    """model_dir: a Hugging Face model directory or a GGUF file. options: a BuildOptions (compiler/options.py: the
    fields and their defaults), or its fields as keywords:
    quant: "" (the checkpoint's weights as stored) or
    one of QUANT_CHOICES (a Hugging Face checkpoint quantized once into the weights cache; weight_types.QUANT_MIXES
    says what each writes, e.g. llama.cpp's Q4_K_M mix: Q6_K for the lm_head and, in some blocks, v and down).
    prefill_activations: "model" (bf16 weights: the AMX prefill GEMM rounds its activations to bf16, as HF's
    bf16 model) or "fp32" (hi + lo split, ~1e-5 of an fp32 GEMM, slower); CPU stages on AMX targets only.
    batch: sequences decoded at once (`helmc serve --max-batch`): the plan counts their KV and activations.
    hybrid: allow hybrid decode layouts (compiler/pipeline.hybrid_allowed says when they are searched).
    sign_key: a private key file (`helmc keygen`) to sign the bundle's manifest with; read before anything is built."""
    from helmc.compiler.pipeline import build as run_pipeline
    options = build_options(options, keywords)
    signer = None
    if sign_key is not None:
        from helmc.runtime.bundle.signature import load_private_key
        signer = load_private_key(sign_key)
    if not os.path.exists(model_dir):
        raise HelmcError(f"model: expected a Hugging Face model directory or a GGUF file, found nothing at {model_dir}")
    from helmc.planner.budget import budgeted
    hw = budgeted(_hardware(hardware), gpu_budget_gib)
    return run_pipeline(model_dir, hw, out_dir, options, signer=signer)


def run(bundle_dir: str, prompt: str | None = None, prompt_ids: list[int] | None = None,
        options: RunOptions | None = None, on_text=None, **keywords):
    """Generate from `bundle_dir` for `prompt` (text) or `prompt_ids`; returns a GenerationResult. options: a
    RunOptions (api_options.py: the fields and their defaults), or its fields as keywords. on_text(str): the text as
    it comes."""
    from helmc.runtime.session import Session
    from helmc.runtime.session_warmup import warm_up_session
    o = options_of(RunOptions, options, keywords, "run")
    check_prompt_text(prompt)
    trust = o.trust_policy()
    session = Session.load(bundle_dir, weights_dir=o.weights_dir, quiet=o.quiet, plan=o.read_plan(), **trust,
                           **o.kv_options())
    if o.warm_up:
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else \
            len(session.tokenizer.encode(prompt).ids) if prompt is not None and session.tokenizer is not None else 0
        warm_up_session(session, prompt_tokens, o.max_new_tokens)
    return session.generate(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=o.max_new_tokens,
                            temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, seed=o.seed, on_text=on_text)


def check_prompt_text(prompt: str | None, what: str = "--prompt") -> None:
    """A prompt is text: bytes that are not UTF-8 in argv arrive as lone surrogates (Python's surrogateescape), which
    no tokenizer takes; refused in one line, before the bundle is read."""
    if prompt is None:
        return
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = prompt.encode("utf-8", "surrogateescape")[max(0, e.start - 8):e.end + 8]
        raise HelmcError(f"{what}: expected UTF-8 text, found bytes that are not UTF-8 at character {e.start} "
                         f"(near {raw!r}); check the terminal's or the script's encoding") from None


@dataclass(frozen=True)
class KitBuilt:
    out_dir: str
    kit: object                         # hardware.kit.ProfileKit
    target: object                      # compiler.profile_kit.KitTarget


def build_kit(out_dir: str, for_hardware: str | None = None, quick: bool = False, gpu_backend: str | None = None,
              progress=None, cache_dir: str | None = None, use_cache: bool = True) -> KitBuilt:
    """A profile kit (`helmc profile --build-kit`) in the new or empty directory `out_dir`, for the machine
    `for_hardware` describes (a hardware.json or a preset) or else this one; `helmc profile --kit` measures with
    it where no compiler is installed. A kit for the same target in the artifact cache (`helmc profile` keeps the
    one it measures with there) is copied; else it is built and stored there. progress: a runtime.progress.Progress
    or a callable (default: Progress())."""
    from helmc.compiler.profile_kit import KitTarget, copy_kit
    from helmc.runtime.progress import Progress
    if for_hardware:
        from helmc.hardware.profile import load_hardware
        target = KitTarget.of_profile(load_hardware(for_hardware), quick=quick)
    else:
        from helmc.hardware.measure import cpu_facts
        from helmc.hardware.measure_gpu import probe_arch
        f = cpu_facts()
        target = KitTarget(f.features, f.l3_bytes, f.cores, probe_arch(gpu_backend)[0], quick)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise HelmcError(f"--build-kit expected a new or empty directory, found {out_dir} with files in it")
    kit = copy_kit(out_dir, target, cache_dir=cache_dir, use_cache=use_cache, progress=progress or Progress())
    return KitBuilt(out_dir, kit, target)


def calibrate(bundle_dirs: "str | list[str]", hardware, options: CalibrateOptions | None = None, **keywords):
    """Time the bundles' decode step on this machine and fit each device's per-block and per-token overheads
    against `hardware` (planner/calibrate.py); returns a CalibrationResult (.profile: the calibrated profile).
    options: a CalibrateOptions, or its fields as keywords."""
    from helmc.planner.calibrate import calibrate as fit
    o = options_of(CalibrateOptions, options, keywords, "calibrate")
    return fit(bundle_dirs, hardware, weights_dir=o.weights_dir, steps=o.steps, **o.trust_policy())


def keygen(key_file: str):
    """A new ed25519 key pair for signing bundles: key_file (private, mode 0600) and key_file.pub; returns the public
    key (.source, .fingerprint)."""
    from helmc.runtime.bundle.signature import generate_keypair
    return generate_keypair(key_file)


def runtime_only() -> None:
    """Bar torch and onnx from this process (runtime/isolation.py): a command that runs a bundle calls it first."""
    from helmc.runtime.isolation import forbid_compiler_imports
    forbid_compiler_imports()


@dataclass(frozen=True)
class Listening:
    """What `serve` tells its caller once the server listens."""
    host: str
    port: int
    model_name: str
    max_batch: int
    max_context: int
    chat_template: bool                 # chat requests are served (else they get a 400)


def serve(bundle_dir: str, options: ServeOptions | None = None, on_ready=None, on_warning=None, **keywords) -> None:
    """Serve `bundle_dir` over HTTP with OpenAI's API (runtime/serve/) until interrupted. The port is bound before
    the model loads (a busy one fails at once); on_warning(text): a chat template the server refuses (chat
    requests get a 400, completions are served); on_ready(Listening) once it listens. options: a ServeOptions, or
    its fields as keywords."""
    o = options_of(ServeOptions, options, keywords, "serve")
    trust = o.trust_policy()                                 # the keys are read before anything else
    _need_serve_extra()
    from helmc.runtime.serve.load import load_engine
    from helmc.runtime.serve.metrics import Metrics
    from helmc.runtime.serve.render import RenderPool
    from helmc.runtime.serve.server import ServeState, bind, serve as run_server
    sock = bind(o.host, o.port)                              # a busy port fails before the model loads
    metrics = Metrics()
    plan = o.read_plan()
    engine, template = load_engine(bundle_dir, o.max_batch, o.weights_dir, quiet=False, metrics=metrics,
                                   compile_template=False, kv_page_tokens=o.kv_page_tokens, plan=plan,
                                   **trust)  # warm-up: stderr
    name = o.model_name or model_id(bundle_dir)
    renderer = RenderPool(template, engine.tokenizer, engine.model.max_context).start()
    refused = renderer.check_template()
    if refused and on_warning is not None:
        on_warning(refused)
    state = ServeState(engine, name, renderer, metrics, engine.model.spec.vocab_size)
    metrics.watch(engine)
    engine.start()

    def ready(port):
        if on_ready is not None:
            on_ready(Listening(o.host, port, name, engine.model.max_batch, engine.model.max_context,
                               bool(template and not refused)))
    try:
        run_server(state, sock, o.log_level, ready)
    finally:
        engine.stop()
        renderer.close()


def _need_serve_extra():
    """Import the serve extra's packages now, before any loading: one that is missing stops the command with the
    line naming the extra (helmc/cli/extras.py, through the CLI's error handling)."""
    import jinja2  # noqa: F401
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401


def model_id(bundle_dir: str) -> str:
    """The id clients send: the bundle directory's name without a trailing .bundle."""
    name = os.path.basename(os.path.normpath(bundle_dir))
    return name[:-len(".bundle")] if name.endswith(".bundle") and len(name) > len(".bundle") else name


def chat(bundle_dir: str, options: ChatOptions | None = None, **keywords):
    """A runtime.serve.conversation.Conversation with `bundle_dir` through the serving engine (one slot).
    options: a ChatOptions (how replies are sampled; checked before any loading), or its fields as keywords."""
    import jinja2  # noqa: F401   (the chat template; missing: the line naming the serve extra, helmc/cli/extras.py)
    from helmc.runtime.serve.conversation import Conversation
    from helmc.runtime.serve.load import load_engine
    o = options_of(ChatOptions, options, keywords, "chat")
    trust = o.trust_policy()
    engine, template = load_engine(bundle_dir, 1, o.weights_dir, plan=o.read_plan(), **trust)
    if template is None:
        raise HelmcError(f"chat: expected a chat template in {bundle_dir} (tokenizer_config.json or chat_template.jinja), "
                         "found none; use helmc run --prompt")
    return Conversation(engine, template, o.sampling())
