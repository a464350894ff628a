"""GGUF files (llama.cpp's format) as a model input: the ModelSpec, the tensor names and types, the tokenizer.

A GGUF file is one self-contained model: hyper-parameters as `{arch}.*` keys, the tokenizer as
`tokenizer.ggml.*` keys, then tensors under llama.cpp's names (`blk.N.attn_q.weight`) with their dims
listed ne0 first (the reverse of NumPy / Hugging Face order) and their data at aligned offsets. helmc
keeps Hugging Face names everywhere else. This module derives the same ModelSpec that `ModelSpec.from_hf_config`
gives for the original config.json and checks every tensor's type and shape against it before anything binds; the
names both ways (one table, shared with the HF -> GGUF writer) are gguf_names.py's, the header's parsing and its
checks gguf_header.py's (through the `gguf` package, llama.cpp's own reader: `pip install 'helmc[gguf]'`), and
their public names are importable from here too.
Supported: architectures qwen3, qwen2, llama (Mistral files are llama; llama with experts is Mixtral), qwen3moe, phi3
(its fused tensors split); tensor types F32, F16, BF16,
Q8_0, Q4_0, Q4_K, Q6_K; byte-level BPE tokenizers (tokenizer.ggml.model "gpt2").
"""
from __future__ import annotations

import math

import numpy as np

from helmc.errors import HelmcError
from helmc.model.arch import GGUF_ARCHITECTURES as ARCH_BY_GGUF
from helmc.model.arch.tensors import EXTRA_TENSORS
from helmc.model.gguf_gemma import gemma_gguf_fields, gpt_oss_gguf_fields
# The header's and the names' public parts, re-exported: callers import them from here.
from helmc.model.gguf_header import (SUPPORTED_TYPES, GGUFHeader, GGUFTensor, expert_slices, field_value,  # noqa: F401
                                     file_architecture, fused_slices, open_gguf_reader, read_gguf_header)
from helmc.model.gguf_names import (GGUF_ROUTER, gguf_name, hf_name, permuted_heads, qk_rows_to_gguf,  # noqa: F401
                                    qk_rows_to_hf)
from helmc.model.gguf_rope import yarn_gguf_rope
from helmc.model.moe import MoeSpec
from helmc.model.spec import ModelSpec, RopeSpec

# general.architecture -> the HF class a file of it reads as (helmc.model.arch's entries).
GGUF_ARCHITECTURES = {g: a.hf_class for g, a in ARCH_BY_GGUF.items()}


# ---- the ModelSpec --------------------------------------------------------------------------------
def _f32(v: float) -> float:
    # GGUF stores these as float32; the shortest decimal that rounds to it is what config.json said (1e-06).
    return float(str(np.float32(v)))


def spec_from_gguf_header(h: GGUFHeader) -> ModelSpec:
    entry = file_architecture(h.architecture, h.metadata, h.tensors)
    if entry is None:
        raise HelmcError(f"{h.path}: general.architecture expected one of {', '.join(GGUF_ARCHITECTURES)} "
                         f"(Mistral files are llama, Mixtral's llama with experts), found {h.architecture!r}")
    arch = h.architecture
    missing = object()

    def key(name, default=missing, kind=int):
        full = f"{arch}.{name}"
        v = h.metadata.get(full, missing)
        if v is missing:
            if default is missing:
                raise HelmcError(f"{h.path}: required key {full!r} missing for {arch}")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:   # also a per-layer list
            raise HelmcError(f"{h.path}: {full!r} expected one positive number, found {v!r:.80}")
        return kind(v)

    H, heads = key("embedding_length"), key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    head_dim = key("attention.key_length", H // heads)
    for k, why in (("attention.value_length", "= key_length"), ("rope.dimension_count", "RoPE over the whole head")):
        if (v := key(k, head_dim)) != head_dim:
            raise HelmcError(f"{h.path}: {arch}.{k} expected {head_dim} ({why}), found {v}")
    if heads % kv_heads:
        raise HelmcError(f"{h.path}: head_count ({heads}) must be a multiple of head_count_kv ({kv_heads})")
    if head_dim % 2:
        raise HelmcError(f"{h.path}: head dim must be even for RoPE, found {head_dim}")
    theta = _f32(key("rope.freq_base", 10000.0, float))   # llama.cpp's default when the key is absent
    if "rope_factors_long.weight" in h.tensors or "rope_factors_short.weight" in h.tensors:
        raise HelmcError(f"{h.path}: RoPE scaling expected none or linear, found longrope (rope_factors_long / "
                         f"rope_factors_short tensors), which helmc does not build")

    embd = h.tensors.get("token_embd.weight")
    if embd is None or len(embd.dims) != 2:
        raise HelmcError(f"{h.path}: tensor 'token_embd.weight' (model.embed_tokens.weight): expected GGUF dims "
                         f"[{H}, vocab], found {list(embd.dims) if embd else 'no such tensor'}")
    vocab = embd.dims[1]
    for what, n in (("tokenizer.ggml.tokens lists", h.n_tokens), (f"{arch}.vocab_size says", key("vocab_size", 0))):
        if n and n != vocab:
            raise HelmcError(f"{h.path}: vocabulary: token_embd.weight has {vocab} rows, {what} {n} tokens")
    eos = [h.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if isinstance(e, int)))   # distinct, in this order
    bos = h.metadata.get("tokenizer.ggml.bos_token_id")
    fields = dict(
        architecture=entry.hf_class, hidden_size=H, intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=int(vocab), rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", kind=float)),
        rope=_rope(h, key, theta, head_dim), max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in h.tensors,
        # the activation / KV precision reference: quantized weights carry their own type per tensor
        dtype={"f32": "float32", "bf16": "bfloat16"}.get(embd.type, "float16"),
        qkv_bias="blk.0.attn_q.bias" in h.tensors, qk_norm=entry.qk_norm,
        sliding_window=_sliding_window(h) if entry.sliding_window else 0,
        bos_token_id=int(bos) if isinstance(bos, int) else -1, eos_token_ids=eos_ids)
    if entry.moe:
        fields["moe"] = _moe(h, key, fields["num_layers"], entry.moe_naming)
    if entry.local_rope:
        fields.update(gemma_gguf_fields(h.path, h.architecture, h.metadata, key, fields))
    if entry.attn_sinks:
        fields.update(gpt_oss_gguf_fields(h.path, h.architecture, h.metadata, h.tensors, key, fields))
    try:
        return ModelSpec(**fields)
    except HelmcError as e:                  # ModelSpec's own checks: say which file they are about
        raise HelmcError(f"{h.path}: {e}") from None


def _sliding_window(h: GGUFHeader) -> int:
    """{arch}.attention.sliding_window, config.json's sliding_window as the converter copies it (0 or absent: none)."""
    v = h.metadata.get(f"{h.architecture}.attention.sliding_window", 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise HelmcError(f"{h.path}: {h.architecture}.attention.sliding_window expected a non-negative integer, "
                         f"found {v!r:.40}")
    return v


def _moe(h: GGUFHeader, key, num_layers: int, naming: str) -> MoeSpec:
    """The experts' layout of a MoE file: {arch}.expert_count, expert_used_count, expert_feed_forward_length (absent
    from llama files, whose experts are feed_forward_length wide, as llama.cpp reads them); a block without a router
    (ffn_gate_inp) is dense; llama.cpp renormalises the top-k of qwen3moe and of llama with experts always."""
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.{GGUF_ROUTER}" not in h.tensors)
    try:
        return MoeSpec(num_experts=key("expert_count"), top_k=key("expert_used_count"), norm_topk_prob=True,
                       expert_intermediate_size=key("expert_feed_forward_length", key("feed_forward_length")),
                       dense_layers=dense, naming=naming)
    except HelmcError as e:
        raise HelmcError(f"{h.path}: {e}") from None


def _rope(h: GGUFHeader, key, theta: float, head_dim: int) -> RopeSpec:
    kind = h.metadata.get(f"{h.architecture}.rope.scaling.type")
    factor = key("rope.scaling.factor", 0.0, float) or key("rope.scale_linear", 0.0, float)
    if kind is None and factor not in (0.0, 1.0):
        kind = "linear"                     # older files: rope.scale_linear without a scaling type
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=_f32(factor))
    if kind == "yarn":
        return yarn_gguf_rope(h.path, h.architecture, h.metadata, key, theta, factor)
    if kind not in (None, "none"):
        raise HelmcError(f"{h.path}: {h.architecture}.rope.scaling.type expected none, linear or yarn, found {kind!r}")
    if h.rope_freqs:
        return _llama3_rope(h.path, h.rope_freqs, theta, head_dim)
    return RopeSpec(theta=theta)


def _llama3_factors(freq: np.ndarray, factor: float, low: float, high: float, old: int) -> np.ndarray:
    # llama.cpp stores the divisor of each inverse frequency (convert_hf_to_gguf's rope_factors)
    wavelen = 2 * math.pi / freq
    smooth = (old / wavelen - low) / (high - low)
    with np.errstate(divide="ignore"):      # only used where 0 <= smooth <= 1
        mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _llama3_rope(path: str, factors: tuple[float, ...], theta: float, head_dim: int) -> RopeSpec:
    """Llama 3's RoPE scaling from the rope_freqs.weight factors (the file has no keys for it).

    The factors depend on (old_ctx, low, high) only through a = old/(high-low) and b = low/(high-low),
    so every triple with the same a, b gives the same frequencies: with >= 2 factors strictly between 1
    and `factor` a line fit gives a, b and low is set to 1; otherwise Llama 3.1's (1, 4, 8192) is tried.
    Whatever is chosen must reproduce every stored factor."""
    f = np.asarray(factors, dtype=np.float64)
    if f.size != head_dim // 2:           # before sizing anything by head_dim, which a corrupt header sets at will
        raise HelmcError(f"{path}: rope_freqs.weight expected {head_dim // 2} factors (head dim {head_dim} / 2), found {f.size}")
    freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # [D/2]
    factor = float(f.max())
    if factor <= 1.0:
        return RopeSpec(theta=theta)
    candidates = []
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if mid.sum() >= 2:
        smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        a, minus_b = np.polyfit(freq[mid] / (2 * math.pi), smooth, 1)   # smooth = a / wavelen - b
        if -minus_b > 0:
            candidates.append((1.0, round(1 - 1 / minus_b, 4), int(round(-a / minus_b))))
    candidates.append((1.0, 4.0, 8192))
    for low, high, old in candidates:
        if np.allclose(_llama3_factors(freq, factor, low, high, old), f, rtol=1e-4):
            return RopeSpec(theta=theta, kind="llama3", factor=_f32(factor), low_freq_factor=low,
                            high_freq_factor=high, original_max_position=old)
    raise HelmcError(f"{path}: rope_freqs.weight: expected Llama 3 RoPE scaling factors, found {list(np.round(f, 4))} "
                     "that no (factor, low, high, original context) reproduces")


# ---- tensors: names, types, shapes ----------------------------------------------------------------
def expected_hf_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight (runtime.weights.bind.expected_tensors; the model layer cannot import it)."""
    out = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    for i in range(spec.num_layers):
        out.update({f"model.layers.{i}.{n}": s for n, s in spec.block_weight_shapes(i).items()})
    return out


def _types(h: GGUFHeader) -> dict[str, str]:
    out = {}
    entry = file_architecture(h.architecture, h.metadata, h.tensors)
    naming = entry.moe_naming if entry is not None else "qwen_moe"
    arch = entry.hf_class if entry is not None else None
    for t in h.tensors.values():
        if t.name in EXTRA_TENSORS:
            continue
        try:
            hf = hf_name(t.name, naming, arch)
        except HelmcError:
            raise HelmcError(f"{h.path}: unexpected tensor {t.name!r}: not part of a qwen3/qwen2/llama model helmc runs") from None
        if t.type not in SUPPORTED_TYPES:
            raise HelmcError(f"{h.path}: tensor {t.name!r} ({hf}) has type {t.type.upper()}; helmc reads "
                             f"{', '.join(s.upper() for s in SUPPORTED_TYPES)}")
        out[hf] = t.type
    return out


def check_gguf_tensors(h: GGUFHeader, spec: ModelSpec) -> dict[str, str]:
    """Every tensor the spec needs is present with its shape and a supported type, and nothing else is
    there; returns HF name -> type name."""
    types = _types(h)
    expected = expected_hf_tensors(spec)
    for hf, shape in expected.items():
        g = gguf_name(hf, spec.architecture)
        t = h.tensors.get(g)
        if t is None:
            raise HelmcError(f"{h.path}: missing tensor {g!r} ({hf}): expected shape {list(shape)} "
                             f"(GGUF dims {list(reversed(shape))}) for this {h.architecture} model")
        if t.shape != tuple(shape):
            raise HelmcError(f"{h.path}: tensor {g!r} ({hf}): expected GGUF dims {list(reversed(shape))} (HF shape "
                             f"{list(shape)}) from the model's hyper-parameters, found dims {list(t.dims)} "
                             f"(HF shape {list(t.shape)})")
    for hf in types:
        if hf not in expected:
            raise HelmcError(f"{h.path}: unexpected tensor {gguf_name(hf, spec.architecture)!r} ({hf}): not part of this "
                             f"{h.architecture} model ({spec.num_layers} blocks, qkv_bias={spec.qkv_bias}, "
                             f"tied embeddings={spec.tie_word_embeddings})")
    return types


def read_gguf_spec(path: str) -> ModelSpec:
    """The ModelSpec of a GGUF file, after checking every tensor's presence, shape and type against it."""
    h = read_gguf_header(path)
    check_gguf_tensors(h, spec := spec_from_gguf_header(h))
    return spec


def gguf_tensor_types(path: str) -> dict[str, str]:
    """HF tensor name -> lower-case type name (a weight_types.WEIGHT_TYPES key); any other type
    raises a HelmcError naming the tensor and its type."""
    return _types(read_gguf_header(path))
