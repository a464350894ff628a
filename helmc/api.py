"""The plain Python API under the CLI: profile, plan, build, run."""
from __future__ import annotations

import os

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


def plan(model_dir_or_config: str, hardware, prompt_len: int = 128, output_len: int = 128, batch: int = 1,
         objective: str = "decode", gpu_budget_gib: float | None = None, kv_offload: bool = True, hybrid: bool = True):
    from helmc.planner.search_partition import plan as search
    return search(model_dir_or_config, _hardware(hardware), prompt_len=prompt_len, output_len=output_len, batch=batch,
                  objective=objective, gpu_budget_gib=gpu_budget_gib, kv_offload=kv_offload, hybrid=hybrid)


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
