"""Phase 1 of a build: the model, from a Hugging Face directory or a GGUF file, as a ModelSource.

- a Hugging Face directory: config.json -> ModelSpec; the weights stay in its safetensors;
- the same with `quant` (a weight_types.QUANT_MIXES name): its weights quantized once into a GGUF file in the weights
  cache (quantize_checkpoint; streamed tensor by tensor), which the bundle then reads like any GGUF;
- a GGUF file: architecture, hyper-parameters, per-tensor types and the tokenizer from the file.
Only headers are read here (and, with `quant`, the weights once); weights bind at run time.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from helmc.compiler.model_files import check_model_files
from helmc.errors import HelmcError
from helmc.jsonio import read_regular_file
from helmc.model.arch import ARCHITECTURES, GGUF_ARCHITECTURES
from helmc.model.load import is_gguf, load_spec
from helmc.model.spec import ModelSpec

_HASHED_HEADER_BYTES = 1 << 20
# Mixture-of-experts architectures --quant writes a GGUF of (one whose experts stack in GGUF tensors helmc reads back).
_QUANTIZABLE_MOE = tuple(a.hf_class for a in ARCHITECTURES.values()
                         if a.moe and (a.reads_gguf or a.reads_gguf_with_experts))


@dataclass(frozen=True)
class ModelSource:
    spec: ModelSpec                   # with the tensors' quantized types when the weights are quantized
    config_sha256: str                # of config.json, or of a GGUF file's first MiB and size
    weights: str                      # a directory of safetensors or a .gguf file
    tokenizer_dir: str = ""           # where tokenizer.json & co. are (a Hugging Face directory), or ""
    tokenizer_json: str = ""          # the tokenizer read from a GGUF file, when there is no tokenizer_dir
    chat_template: str = ""

    @property
    def is_gguf(self) -> bool:
        return self.weights.endswith(".gguf")


def read_model(path: str, quant: str = "", cache_dir: str | None = None, progress=lambda m: None) -> ModelSource:
    if is_gguf(path):
        if quant:
            raise HelmcError(f"--quant: expected a Hugging Face model directory to quantize, found the file {path} "
                             "(a GGUF file is already quantized: build it without --quant)")
        return _read_gguf(path, progress=progress)
    spec = ModelSpec.from_model_dir(path)
    config = os.path.join(path, "config.json") if os.path.isdir(path) else path
    config_sha = hashlib.sha256(read_regular_file(config, "model config")).hexdigest()
    model_dir = path if os.path.isdir(path) else os.path.dirname(path)
    check_model_files(model_dir)                 # before anything is compiled: what the bundle will copy
    if not quant:
        _check_weights(model_dir, spec)
        return ModelSource(spec, config_sha, model_dir, tokenizer_dir=model_dir)
    writable = [a.hf_class for a in ARCHITECTURES.values()       # --quant goes through a GGUF file helmc writes
                if a.gguf_arch in GGUF_ARCHITECTURES and not a.fused_projections and not a.moe
                and not a.norm_offset]                     # Gemma: its writer's metadata and norm offset not built
    if spec.architecture not in writable + list(_QUANTIZABLE_MOE):
        raise HelmcError(f"--quant: expected one of {', '.join(writable + list(_QUANTIZABLE_MOE))}, found "
                         f"{spec.architecture} (build it without --quant)")
    from helmc.compiler.artifact_cache import default_cache_dir
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    gguf = quantize_checkpoint(model_dir, quant, cache_dir or os.path.join(default_cache_dir(), "weights"), progress)
    source = _read_gguf(gguf, with_tokenizer=False)
    return ModelSource(source.spec, config_sha, gguf, tokenizer_dir=model_dir)


def _check_weights(model_dir: str, spec) -> None:
    """The safetensors' headers against config.json (headers only: no tensor is read), so a build refuses weights
    `helmc run` would refuse, before anything is compiled or written. A directory without weights is left alone:
    they may come at run time (helmc run --weights)."""
    from helmc.runtime.weights.bind import check_checkpoint
    from helmc.runtime.weights.safetensors_mmap import Checkpoint
    if not any(os.path.exists(os.path.join(model_dir, n)) for n in ("model.safetensors", "model.safetensors.index.json")):
        return
    ck = Checkpoint.for_spec(model_dir, spec)
    try:
        check_checkpoint(ck, spec)
    finally:
        ck.close()


def _read_gguf(path: str, with_tokenizer: bool = True, progress=lambda m: None) -> ModelSource:
    from helmc.model.gguf_tokenizer import read_gguf_tokenizer
    spec = load_spec(path)
    h = hashlib.sha256(str(os.path.getsize(path)).encode())
    with open(path, "rb") as f:
        h.update(f.read(_HASHED_HEADER_BYTES))
    tokenizer_json, template = "", ""
    if with_tokenizer:
        try:
            tokenizer_json, template = read_gguf_tokenizer(path)
        except HelmcError as e:       # the weights still run, from token ids (helmc run --prompt-ids)
            progress(f"read_model: no tokenizer in the bundle: {e}; run it with --prompt-ids")
    return ModelSource(spec, h.hexdigest(), os.path.abspath(path), tokenizer_json=tokenizer_json,
                       chat_template=template or "")
