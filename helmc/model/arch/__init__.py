"""The architecture registry: one module per architecture in this folder, each an `ARCH` entry; `ARCHITECTURES`
lists them, keyed by the Hugging Face class name that config.json's `architectures` gives (and ModelSpec keeps).

An entry says everything that differs between architectures, and every other module asks it rather than compare
names: the HF class and config `model_type`, the GGUF `general.architecture` llama.cpp writes (and whether a file
of that name reads back as this class: Mistral is written as llama), how config.json's keys map to the block's
features (q/k/v bias, q/k RMSNorm, sliding window), the HF <-> GGUF tensor names of its block (`tensors.py`) and
llama.cpp's per-head row permutation of q/k, the GGUF pre-tokenizer to write when tokenizer.json's is not
recognised. The block's ONNX export (compiler/passes/export_block.py) and the lowering passes that match its ops
(lower_linear's linears, fuse_gpu_norms' norms and q/k norm + RoPE) follow the features, not the name: an
architecture made of the existing features is one entry here.

To add one: a module here with its `ARCH` (and, for a block of other tensors, their names in `tensors.py`), its
name in `_MODULES`, and a tiny model of it in helmc/testing.py so the end-to-end tests compare it with
transformers. A block of another kind (a mixture-of-experts FFN: a router and experts) adds its tensors' names, its
feature in ModelSpec and its export and kernels besides.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from helmc.errors import HelmcError
from helmc.model.arch.tensors import DENSE_BLOCK, QK_PERMUTED


@dataclass(frozen=True)
class Architecture:
    hf_class: str                    # config.json architectures[0], ModelSpec.architecture
    model_type: str                  # config.json model_type
    gguf_arch: str                   # GGUF general.architecture as llama.cpp's converter writes it
    # A GGUF file of gguf_arch reads back as this class (False where another entry owns the name: Mistral -> llama).
    reads_gguf: bool = True
    # A GGUF file of gguf_arch with experts ({gguf_arch}.expert_count > 0) reads back as this class, though the name
    # is another entry's (Mixtral: llama with experts).
    reads_gguf_with_experts: bool = False
    qkv_bias: bool = False           # q/k/v biases always (else only where config.json sets attention_bias)
    qk_norm: bool = False            # RMSNorm over each q and k head before RoPE
    # config.json's sliding_window applies always (else only where use_sliding_window is true).
    sliding_window: bool = False
    # HF suffix under model.layers.N. -> GGUF suffix under blk.N. of every tensor the block may have.
    block_tensors: dict = field(default_factory=lambda: dict(DENSE_BLOCK))
    # llama.cpp's converter permutes the rows of these GGUF block tensors per head (q: "q" heads, k: "kv" heads).
    permuted_tensors: dict = field(default_factory=dict)
    # Writes {arch}.vocab_size and rope.dimension_count, as llama.cpp's converter does for this architecture.
    gguf_vocab_and_rope_dims: bool = False
    pre_tokenizer: str = "llama-bpe" # GGUF tokenizer.ggml.pre when tokenizer.json's pre-tokenizer is not recognised
    moe: bool = False                # a routed mixture of experts as the feed-forward (layout: helmc/model/moe.py)
    moe_naming: str = "qwen_moe"     # the router's and experts' checkpoint names: a helmc.model.moe.NAMINGS key
    # The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (rows stacked in that order): the
    # weights reader splits each into the block's own names as zero-copy row ranges (ModelSpec.fused_rows).
    fused_projections: bool = False
    # Gemma's block: RMSNorm scales by (norm_offset + w) (checkpoints store w - 1 where this is 1.0); norms on the
    # attention output and the MLP output before each residual add (sandwich_norms); token embeddings times
    # sqrt(hidden_size); sliding-window layers interleaved with global ones (config.json's layer_types or
    # sliding_window_pattern), the sliding ones with their own RoPE base (local_rope).
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    scaled_embeddings: bool = False
    local_rope: bool = False
    # gpt-oss's attention: o_proj has a bias wherever q/k/v have one; a learned logit per query head in each
    # softmax's denominator (self_attn.sinks); sliding blocks alternating with full ones by config.json's
    # layer_types, else every alternating_layers-th block full (0: the window, if any, applies to every block).
    o_bias: bool = False
    attn_sinks: bool = False
    alternating_layers: int = 0


_MODULES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral", "phi3", "gemma3", "gpt_oss")

ARCHITECTURES: dict[str, Architecture] = {
    a.hf_class: a for a in (importlib.import_module(f"helmc.model.arch.{m}").ARCH for m in _MODULES)}
# GGUF general.architecture -> the entry a file of that name reads as.
GGUF_ARCHITECTURES: dict[str, Architecture] = {a.gguf_arch: a for a in ARCHITECTURES.values() if a.reads_gguf}
# GGUF general.architecture -> the entry a file of that name with experts reads as, where not the entry above.
GGUF_EXPERT_ARCHITECTURES: dict[str, Architecture] = {
    a.gguf_arch: a for a in ARCHITECTURES.values() if a.reads_gguf_with_experts}


def architecture(hf_class: str, who: str = "model") -> Architecture:
    a = ARCHITECTURES.get(hf_class)
    if a is None:
        raise HelmcError(f"{who}: architecture expected one of {list(ARCHITECTURES)}, found {hf_class!r}")
    return a


def gguf_architecture(gguf_arch: str, experts: bool = False) -> Architecture | None:
    """The entry a GGUF file of general.architecture `gguf_arch` reads as (`experts`: the file has routed experts);
    None for an architecture helmc lacks."""
    if experts and gguf_arch in GGUF_EXPERT_ARCHITECTURES:
        return GGUF_EXPERT_ARCHITECTURES[gguf_arch]
    return GGUF_ARCHITECTURES.get(gguf_arch)


__all__ = ["ARCHITECTURES", "GGUF_ARCHITECTURES", "GGUF_EXPERT_ARCHITECTURES", "Architecture", "QK_PERMUTED", "architecture", "gguf_architecture"]
