"""The options of helmc.api's commands as frozen dataclasses, each with its defaults defined once and checked when
made (a typo costs no load): PlanOptions, RunOptions, ServeOptions, ChatOptions, CalibrateOptions (BuildOptions lives
with the compiler, compiler/options.py). The CLI reads its defaults from these.

run, serve, chat and calibrate load a bundle the same way (BundleOptions): a weights directory, the public key files
whose signature is accepted, and (all but calibrate) a plan file run instead of the bundle's own; paths, read by the
API before anything of the bundle is."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from helmc.compiler.options import BuildOptions
from helmc.errors import HelmcError
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK, KVOptions
from helmc.runtime.sampling import SamplingParams
from helmc.runtime.serve.conversation import Sampling

BUILD_DEFAULTS = BuildOptions()
_CHAT_SAMPLING = Sampling()


def options_of(cls, options, keywords: dict, what: str):
    """`options`, or a `cls` of `keywords` (a function takes one or the other), unknown keywords refused."""
    if options is not None and keywords:
        raise HelmcError(f"{what}: expected a {cls.__name__} or its fields as keywords, found both "
                         f"({', '.join(keywords)})")
    if options is not None:
        if not isinstance(options, cls):
            raise HelmcError(f"{what}: expected a {cls.__name__}, found {type(options).__name__}")
        return options
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(keywords) - names)
    if unknown:
        raise HelmcError(f"{what} options: expected keywords among {', '.join(sorted(names))}, found "
                         f"{', '.join(unknown)}")
    return cls(**keywords)


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
class BundleOptions:
    """How calibrate loads a bundle, and the start of how run, serve and chat do (PlannedBundleOptions)."""
    weights_dir: str | None = None      # a model directory or GGUF file overriding the bundle's
    trust: tuple[str, ...] = ()         # public key files (KEYFILE.pub of `helmc keygen`) whose signature is accepted
    require_signed: bool = False        # refuse a bundle without such a signature (implied by naming a key)

    def __post_init__(self):
        if isinstance(self.trust, str) or not all(isinstance(p, str) for p in self.trust):
            raise HelmcError(f"trust: expected a tuple of public key file paths, found {self.trust!r}"[:200])

    def trust_policy(self) -> dict:
        """Session.load's trusted_keys / require_signed, the keys read now. A key named so requires a signature:
        otherwise an attacker who deletes manifest.sig would get past it. HELMC_TRUSTED_KEYS alone (an ambient
        default for every command) does not."""
        from helmc.runtime.bundle.signature import trusted_keys
        return {"trusted_keys": trusted_keys(self.trust), "require_signed": self.require_signed or bool(self.trust)}


@dataclass(frozen=True)
class PlannedBundleOptions(BundleOptions):
    plan: object = None                 # a plan file (`helmc plan BUNDLE hardware.json -o FILE`) or a Plan, run
                                        # instead of the bundle's own

    def read_plan(self):
        """The Plan to run, or None (the bundle's own)."""
        if self.plan is None or not isinstance(self.plan, str):
            return self.plan
        from helmc.runtime.bundle.plan import read_plan_file
        return read_plan_file(self.plan)


@dataclass(frozen=True)
class RunOptions(PlannedBundleOptions):
    """`run`'s options."""
    max_new_tokens: int = 32
    temperature: float = 0.0            # 0 is greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    kv_page_tokens: int = KV_PAGE_TOKENS
    kv_watermark: float = KV_WATERMARK
    kv_offload: bool = KVOptions().offload
    quiet: bool = True                  # no progress lines while loading
    warm_up: bool = True                # pay the first calls' one-time costs while loading (runtime/session_warmup.py)

    def __post_init__(self):
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise HelmcError(f"--max-new-tokens expected >= 1, found {self.max_new_tokens}")
        SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)
        KVOptions.from_keywords(self.kv_options())

    def kv_options(self) -> dict:
        return {"kv_page_tokens": self.kv_page_tokens, "kv_watermark": self.kv_watermark,
                "kv_offload": self.kv_offload}


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServeOptions(PlannedBundleOptions):
    """`serve`'s options (the plan file is read once the port is bound)."""
    host: str = "127.0.0.1"
    port: int = 8000                    # 0: any free port
    max_batch: int | None = None        # sequences decoded at once (None: what the plan was made for)
    model_name: str | None = None       # the model id clients send (None: the bundle directory's name, less .bundle)
    kv_page_tokens: int = KV_PAGE_TOKENS
    log_level: str = "warning"          # uvicorn's

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise HelmcError(f"--port expected in [0, 65535] (0: any free port), found {self.port}")
        if self.max_batch is not None and self.max_batch < 1:
            raise HelmcError(f"--max-batch expected >= 1 (or left out: the plan's batch), found {self.max_batch}")
        if self.kv_page_tokens < 1:
            raise HelmcError(f"--kv-page-tokens expected a positive integer, found {self.kv_page_tokens}")
        if self.log_level not in LOG_LEVELS:
            raise HelmcError(f"--log-level expected one of {', '.join(LOG_LEVELS)}, found {self.log_level!r}")


@dataclass(frozen=True)
class ChatOptions(PlannedBundleOptions):
    """`chat`'s options: how each reply is sampled (runtime/serve/conversation.Sampling's defaults)."""
    max_new_tokens: int = _CHAT_SAMPLING.max_new_tokens
    temperature: float = _CHAT_SAMPLING.temperature
    top_k: int = _CHAT_SAMPLING.top_k
    top_p: float = _CHAT_SAMPLING.top_p
    seed: int | None = _CHAT_SAMPLING.seed

    def __post_init__(self):
        super().__post_init__()
        self.sampling()

    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.seed)


@dataclass(frozen=True)
class CalibrateOptions(BundleOptions):
    """`calibrate`'s options."""
    steps: int | None = None            # decode steps timed per device (None: the plan's output_len)

    def __post_init__(self):
        super().__post_init__()
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise HelmcError(f"--steps expected a positive integer (or left out: the plan's output_len), found "
                             f"{self.steps!r}")
