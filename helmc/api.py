"""The plain Python API under the CLI: profile, plan, build, run."""
from __future__ import annotations

import os

from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile


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
    kit's compiled stages (planner/calibrate.synthetic_overheads). quick: small sizes, for tests."""
    import os
    import sys
    import time

    from helmc.hardware.measure import cpu_facts, profile as measure

    t0 = time.perf_counter()
    progress = progress or (lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}", file=sys.stderr, flush=True))
    backend = gpu_backend or os.environ.get("HELMC_GPU_BACKEND")
    facts = cpu_facts()
    if kit_dir is None:
        from helmc.compiler.profile_kit import KitTarget, ensure_kit
        from helmc.hardware.measure_gpu import probe_arch
        arch, _ = probe_arch(backend)
        target = KitTarget(facts.features, facts.l3_bytes, facts.cores, arch, quick)
        kit_dir = ensure_kit(target, cache_dir=cache_dir, use_cache=use_cache, progress=progress)
    hw = measure(kit_dir, quick=quick, gpu_backend=backend, progress=progress, facts=facts)
    if overheads:
        from helmc.planner.calibrate import synthetic_overheads
        hw = synthetic_overheads(hw, kit_dir, steps=8 if quick else 16, progress=progress)
    return hw


def plan(model_dir_or_config: str, hardware, prompt_len: int = 128, output_len: int = 128, batch: int = 1,
         objective: str = "decode", gpu_budget_gib: float | None = None, kv_offload: bool = True, hybrid: bool = True):
    from helmc.planner.search_partition import plan as search
    return search(model_dir_or_config, _hardware(hardware), prompt_len=prompt_len, output_len=output_len, batch=batch,
                  objective=objective, gpu_budget_gib=gpu_budget_gib, kv_offload=kv_offload, hybrid=hybrid)


def build(model_dir: str, hardware, out_dir: str, *, gpu_budget_gib: float | None = None, copy_weights: bool = False,
          use_cache: bool = True, cache_dir: str | None = None, prompt_len: int = 128, output_len: int = 128,
          quiet: bool = False, stream_prefill: bool = True, prefill_activations: str = "model", quant: str = "",
          batch: int = 1, hybrid: bool = True):
    """model_dir: a Hugging Face model directory or a GGUF file. quant: "" (the checkpoint's weights as stored) or
    q8_0 | q4_0 | q4_k | q4_k_m (a Hugging Face checkpoint quantized once into the weights cache; q4_k_m is
    llama.cpp's mix: q6_k for the lm_head and, in some blocks, v and down).
    prefill_activations: "model" (bf16 weights: the AMX prefill GEMM rounds its activations to bf16, as HF's
    bf16 model) or "fp32" (hi + lo split, ~1e-5 of an fp32 GEMM, slower); CPU stages on AMX targets only.
    batch: sequences decoded at once (`helmc serve --max-batch`): the plan counts their KV and activations.
    hybrid: allow hybrid decode layouts (compiler/pipeline.hybrid_allowed says when they are searched)."""
    from helmc.compiler.pipeline import build as run_pipeline
    if not os.path.exists(model_dir):
        raise HelmcError(f"model: expected a Hugging Face model directory or a GGUF file, found nothing at {model_dir}")
    hw = _hardware(hardware).with_gpu_budget(gpu_budget_gib)
    return run_pipeline(model_dir, hw, out_dir, copy_weights=copy_weights, use_cache=use_cache, cache_dir=cache_dir,
                        prompt_len=prompt_len, output_len=output_len, quiet=quiet, stream_prefill=stream_prefill,
                        prefill_activations=prefill_activations, quant=quant, batch=batch, hybrid=hybrid)


def run(bundle_dir: str, prompt: str | None = None, prompt_ids: list[int] | None = None, max_new_tokens: int = 32,
        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
        weights_dir: str | None = None, on_text=None, quiet: bool = True, **kv_options):
    from helmc.runtime.session import Session
    session = Session.load(bundle_dir, weights_dir=weights_dir, quiet=quiet, **kv_options)
    return session.generate(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, on_text=on_text)
