"""The plain Python API under the CLI: profile (and build_kit), plan, build, run, calibrate, serve, chat. Each
`helmc` command parses its arguments and calls one function here; the options of the larger ones are frozen
dataclasses (BuildOptions, PlanOptions, ServeOptions) whose defaults are defined once."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from helmc.compiler.options import BuildOptions, build_options
from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile
from helmc.model.weight_types import QUANT_MIXES
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK, KVOptions
# The KV defaults the CLI shows (runtime/kv/options.py defines them): KV_PAGE_TOKENS, KV_WATERMARK.

# `build`'s quant choices (the CLI's --quant): weight_types' mixes; its defaults (BuildOptions').
QUANT_CHOICES = tuple(QUANT_MIXES)
BUILD_DEFAULTS = BuildOptions()


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
class PlanOptions:
    """`plan`'s options. None: PLAN_DEFAULTS' value for a model; a bundle's own plan's for a bundle (whose batch and
    weights are always its own)."""
    prompt_len: int | None = None
    output_len: int | None = None
    batch: int | None = None
    objective: str | None = None        # "decode" (ms per token) or "prefill" (ms to the first token)
    gpu_budget_gib: float | None = None # at most this many GiB of VRAM in all (None: all, or a bundle's plan's)
    kv_offload: bool | None = None      # KV of GPU blocks in pinned host pages
    stream_prefill: bool = True         # the CPU blocks' prefill on the GPU, their weights streamed over PCIe
    hybrid: bool = True                 # hybrid decode layouts allowed where predicted faster
    dtype: str | None = None            # weight dtype (None: the checkpoint's)


# A model's plan where PlanOptions leaves a field None: a build's workload (BuildOptions'), KV offload (KVOptions').
PLAN_DEFAULTS = PlanOptions(prompt_len=BUILD_DEFAULTS.prompt_len, output_len=BUILD_DEFAULTS.output_len,
                            batch=BUILD_DEFAULTS.batch, objective="decode", kv_offload=KVOptions().offload)


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
        p = self.plan
        out = {"cpu_units": p.cpu_units, "gpu_units": p.gpu_units, "t_plan_ms": p.t_plan_ms, "plan": p.describe(),
               "max_context": p.max_context, "candidates": [to_dict(c) for c in p.candidates]}
        if p.is_hybrid:
            out.update(groups=[to_dict(g) for g in p.groups], staging_ring_bytes=p.staging_ring_bytes,
                       t_copy_ms=p.t_copy_ms, hybrid_candidates=[to_dict(c) for c in p.hybrid_candidates])
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
    o = _options(PlanOptions, options, keywords, "plan")
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


def _options(cls, options, keywords: dict, what: str):
    """`options`, or a `cls` of `keywords` (a function takes one or the other), unknown keywords refused."""
    if options is not None and keywords:
        raise HelmcError(f"{what}: expected a {cls.__name__} or its fields as keywords, found both "
                         f"({', '.join(keywords)})")
    if options is not None:
        return options
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(keywords) - names)
    if unknown:
        raise HelmcError(f"{what} options: expected keywords among {', '.join(sorted(names))}, found "
                         f"{', '.join(unknown)}")
    return cls(**keywords)


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


def run(bundle_dir: str, prompt: str | None = None, prompt_ids: list[int] | None = None, max_new_tokens: int = 32,
        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
        weights_dir: str | None = None, on_text=None, quiet: bool = True, trusted_keys: tuple | None = None,
        require_signed: bool = False, plan=None, warm_up: bool = True, **kv_options):
    """trusted_keys: signature.PublicKey of the keys whose signature is accepted (signature.trusted_keys(paths)
    reads them, with HELMC_TRUSTED_KEYS); require_signed: refuse a bundle without such a signature.
    plan: a Plan (e.g. replan_bundle's for this machine) run instead of the bundle's own.
    warm_up: pay the first calls' one-time costs while loading (runtime/session_warmup.py), so that the request's
    TTFT and decode rate are a warm process's."""
    from helmc.runtime.session import Session
    from helmc.runtime.session_warmup import warm_up_session
    check_run_arguments(max_new_tokens, temperature, top_k, top_p, seed, **kv_options)
    check_prompt_text(prompt)
    session = Session.load(bundle_dir, weights_dir=weights_dir, quiet=quiet, trusted_keys=trusted_keys,
                           require_signed=require_signed, plan=plan, **kv_options)
    if warm_up:
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else \
            len(session.tokenizer.encode(prompt).ids) if prompt is not None and session.tokenizer is not None else 0
        warm_up_session(session, prompt_tokens, max_new_tokens)
    return session.generate(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, on_text=on_text)


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


def check_run_arguments(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
                        **kv_options):
    """run's arguments, checked before the bundle is read: a typo costs no load (and writes nothing)."""
    from helmc.runtime.sampling import SamplingParams
    if max_new_tokens < 1:
        raise HelmcError(f"--max-new-tokens expected >= 1, found {max_new_tokens}")
    SamplingParams(temperature, top_k, top_p, seed)
    KVOptions.from_keywords(kv_options)


@dataclass(frozen=True)
class KitBuilt:
    out_dir: str
    kit: object                         # hardware.kit.ProfileKit
    target: object                      # compiler.profile_kit.KitTarget


def build_kit(out_dir: str, for_hardware: str | None = None, quick: bool = False, gpu_backend: str | None = None,
              progress=None) -> KitBuilt:
    """A profile kit (`helmc profile --build-kit`) in the new or empty directory `out_dir`, for the machine
    `for_hardware` describes (a hardware.json or a preset) or else this one; `helmc profile --kit` measures with
    it where no compiler is installed. progress: a runtime.progress.Progress or a callable (default: Progress())."""
    from helmc.compiler.profile_kit import KitTarget, build_kit as build
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
    return KitBuilt(out_dir, build(out_dir, target, progress=progress or Progress()), target)


def calibrate(bundle_dirs: "str | list[str]", hardware, weights_dir: str | None = None, steps: int | None = None,
              trusted_keys: tuple | None = None, require_signed: bool = False):
    """Time the bundles' decode step on this machine and fit each device's per-block and per-token overheads
    against `hardware` (planner/calibrate.py); returns a CalibrationResult (.profile: the calibrated profile)."""
    from helmc.planner.calibrate import calibrate as fit
    return fit(bundle_dirs, hardware, weights_dir=weights_dir, steps=steps, trusted_keys=trusted_keys,
               require_signed=require_signed)


def keygen(key_file: str):
    """A new ed25519 key pair for signing bundles: key_file (private, mode 0600) and key_file.pub; returns the public
    key (.source, .fingerprint)."""
    from helmc.runtime.bundle.signature import generate_keypair
    return generate_keypair(key_file)


def runtime_only() -> None:
    """Bar torch and onnx from this process (runtime/isolation.py): a command that runs a bundle calls it first."""
    from helmc.runtime.isolation import forbid_compiler_imports
    forbid_compiler_imports()


def trust_policy(paths=(), require_signed: bool = False) -> dict:
    """run's, serve's, chat's and calibrate's trusted_keys / require_signed for `--trust` files, read before anything
    of the bundle is. A key named so requires a signature: otherwise an attacker who deletes manifest.sig would get
    past it. HELMC_TRUSTED_KEYS alone (an ambient default for every command) does not."""
    from helmc.runtime.bundle.signature import trusted_keys
    return {"trusted_keys": trusted_keys(paths), "require_signed": require_signed or bool(paths)}


def read_plan(path: str | None):
    """The Plan in a plan file (`helmc plan BUNDLE hardware.json -o FILE`), or None (the bundle's own)."""
    if path is None:
        return None
    from helmc.runtime.bundle.plan import read_plan_file
    return read_plan_file(path)



_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServeOptions:
    """`serve`'s options, checked when made (a typo costs no load)."""
    host: str = "127.0.0.1"
    port: int = 8000                    # 0: any free port
    max_batch: int | None = None        # sequences decoded at once (None: what the plan was made for)
    model_name: str | None = None       # the model id clients send (None: the bundle directory's name, less .bundle)
    weights_dir: str | None = None      # a model directory or GGUF file overriding the bundle's
    kv_page_tokens: int = KV_PAGE_TOKENS
    log_level: str = "warning"          # uvicorn's
    plan: object = None                 # a Plan, or a plan file (read once the port is bound), run instead of the
                                        # bundle's own
    trusted_keys: tuple | None = None   # as run's (trust_policy)
    require_signed: bool = False

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise HelmcError(f"--port expected in [0, 65535] (0: any free port), found {self.port}")
        if self.max_batch is not None and self.max_batch < 1:
            raise HelmcError(f"--max-batch expected >= 1 (or left out: the plan's batch), found {self.max_batch}")
        if self.kv_page_tokens < 1:
            raise HelmcError(f"--kv-page-tokens expected a positive integer, found {self.kv_page_tokens}")
        if self.log_level not in _LOG_LEVELS:
            raise HelmcError(f"--log-level expected one of {', '.join(_LOG_LEVELS)}, found {self.log_level!r}")


@dataclass(frozen=True)
class Listening:
    """What `serve` tells its caller once the server listens."""
    host: str
    port: int
    model_name: str
    max_batch: int
    max_context: int
    chat_template: bool                 # chat requests are served (else they get a 400)


def serve(bundle_dir: str, options: ServeOptions | None = None, on_ready=None, on_warning=None) -> None:
    """Serve `bundle_dir` over HTTP with OpenAI's API (runtime/serve/) until interrupted. The port is bound before
    the model loads (a busy one fails at once); on_warning(text): a chat template the server refuses (chat
    requests get a 400, completions are served); on_ready(Listening) once it listens."""
    o = options or ServeOptions()
    _need_serve_extra()
    from helmc.runtime.serve.load import load_engine
    from helmc.runtime.serve.metrics import Metrics
    from helmc.runtime.serve.render import RenderPool
    from helmc.runtime.serve.server import ServeState, bind, serve as run_server
    sock = bind(o.host, o.port)                              # a busy port fails before the model loads
    metrics = Metrics()
    plan = read_plan(o.plan) if isinstance(o.plan, str) else o.plan
    engine, template = load_engine(bundle_dir, o.max_batch, o.weights_dir, quiet=False, metrics=metrics,
                                   compile_template=False, kv_page_tokens=o.kv_page_tokens, plan=plan,
                                   trusted_keys=o.trusted_keys, require_signed=o.require_signed)  # warm-up: stderr
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


def chat(bundle_dir: str, sampling=None, weights_dir: str | None = None, plan=None, trusted_keys: tuple | None = None,
         require_signed: bool = False):
    """A runtime.serve.conversation.Conversation with `bundle_dir` through the serving engine (one slot).
    sampling: a runtime.serve.conversation.Sampling (chat_sampling makes one; checked before any loading)."""
    import jinja2  # noqa: F401   (the chat template; missing: the line naming the serve extra, helmc/cli/extras.py)
    from helmc.runtime.serve.conversation import Conversation, Sampling
    from helmc.runtime.serve.load import load_engine
    sampling = sampling or Sampling()
    engine, template = load_engine(bundle_dir, 1, weights_dir, plan=plan, trusted_keys=trusted_keys,
                                   require_signed=require_signed)
    if template is None:
        raise HelmcError(f"chat: expected a chat template in {bundle_dir} (tokenizer_config.json or chat_template.jinja), "
                         "found none; use helmc run --prompt")
    return Conversation(engine, template, sampling)


def chat_sampling(**fields):
    """A runtime.serve.conversation.Sampling (max_new_tokens, temperature, top_k, top_p, seed), checked now."""
    from helmc.runtime.serve.conversation import Sampling
    return Sampling(**fields)
