"""Quantize-at-build: a Hugging Face checkpoint -> one GGUF file in llama.cpp's block formats, cached.

    path = quantize_checkpoint("Qwen3-8B/", "q4_k_m", "artifacts/cache/gguf", progress=print)

What is quantized: the 2-D linear weights of every block (q/k/v/o, gate/up/down) and the lm_head, to `quant`
(a weight_types.QUANT_MIXES name: one block type, or llama.cpp's mix of two). Norm weights and biases stay F32: they are tiny and the activations they scale are
fp32 anyway. The token embedding is written F16 (as llama.cpp's converter writes it at --outtype f16, and
llama-quantize keeps it above the linears' precision): its rows are gathered one token at a time, never
multiplied as a matrix, so a block format would save disk but no bandwidth that matters. A checkpoint
with tied embeddings gets an output.weight too, quantized from the embedding, so the lm_head GEMV reads
`quant` bytes like every other linear (llama.cpp loads it in place of the tied embedding).
A linear whose input width k is not a multiple of the block size (Q4_K: 256; e.g. Qwen2.5-0.5B's 896)
falls back to the mix's fallback (Q8_0) when k is a multiple of its block, else F16, as llama-quantize falls back to a smaller
block; progress says which, and each tensor's type is in the file.

File contents follow llama.cpp's convert_hf_to_gguf.py for qwen3 / qwen2 / llama (Mistral is llama there):
its metadata keys, GGUF tensor names (token_embd.weight, blk.N.attn_q.weight, ..., output_norm.weight,
output.weight: helmc.model.gguf_spec's one table, which helmc's GGUF reader uses too), for
llama the q/k row permutation its converter applies (llama.cpp's RoPE pairs dimensions (2i, 2i+1), HF's
(i, i + d/2); gguf_spec.qk_rows_to_gguf), the rope_freqs tensor for llama3 RoPE, and the gpt2-style
tokenizer keys when the directory has a byte-level BPE tokenizer.json.

Streaming: tensor infos are declared first (shapes and byte counts are known from the safetensors headers),
then each tensor is read through the mmapped Checkpoint, converted and quantized in chunks of rows, and
written. Peak RAM beyond the page cache: one tensor's output bytes (the largest is the F16 embedding or the
quantized lm_head: vocab x hidden x {2 | 1.06 | 0.56 | 0.56} bytes, 1.2 GiB at most for Qwen3-8B) plus one
chunk of float32 rows (~64 MiB); never a float32 copy of a whole tensor.

Cache: the file is cache_dir/<key>.gguf, the key a sha256 over the checkpoint's files (name, size, sha256 of
the safetensors header), config.json, the tokenizer files, `quant` and FORMAT_VERSION. Tensor data is not
hashed (16 GB would take minutes): a checkpoint rewritten in place with identical headers and sizes is not
noticed. The file is written under a temporary name in the same directory and renamed when complete.
"""
from __future__ import annotations

import hashlib
import math
import json
import os
import struct
from typing import Callable

import gguf
import numpy as np

from helmc.errors import HelmcError
from helmc.model.arch import ARCHITECTURES, GGUF_ARCHITECTURES
from helmc.model.gguf_spec import gguf_name, permuted_heads, qk_rows_to_gguf
from helmc.model.gguf_tokenizer import PRE_TOKENIZERS
from helmc.model.quant_formats import quant_type, quantize
from helmc.model.spec import ModelSpec
from helmc.model.weight_types import QUANT_MIXES, quant_mix
from helmc.runtime.progress import steps
from helmc.runtime.weights.safetensors_mmap import Checkpoint

CHECKPOINT_QUANTS = tuple(QUANT_MIXES)
FORMAT_VERSION = 2                  # bump when the quantizers, the layout or the metadata written change
_CHUNK_BYTES = 64 << 20             # float32 rows converted and quantized at a time
# HF architecture -> general.architecture as llama.cpp's converter writes it (Mistral as llama).
# A MoE architecture whose GGUF files helmc reads back (qwen3moe; Mixtral as llama with experts); none whose
# checkpoint fuses q/k/v and gate/up (Phi-3: llama.cpp keeps them fused, helmc writes them split), nor gpt-oss
# (its fused, biased experts and sinks: llama.cpp's own converter writes its files).
_GGUF_ARCH = {hf: a.gguf_arch for hf, a in ARCHITECTURES.items()
              if (a.reads_gguf or a.reads_gguf_with_experts or not a.moe) and not a.fused_projections
              and a.gguf_arch in GGUF_ARCHITECTURES and not a.norm_offset and not a.attn_sinks}
_LINEARS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")

Progress = Callable[[str], None]


def quantize_checkpoint(model_dir: str, quant: str, cache_dir: str, progress: Progress | None = None) -> str:
    """Path of the GGUF file of model_dir's weights quantized to `quant`; made once, then found in the cache."""
    say = progress or (lambda _msg: None)
    quant_mix(quant)                                     # a HelmcError naming the choices for anything else
    spec = ModelSpec.from_model_dir(model_dir)
    ckpt = Checkpoint.for_spec(model_dir, spec)
    try:
        key = cache_key(model_dir, ckpt, quant)
        path = os.path.join(cache_dir, f"{key}.gguf")
        if os.path.exists(path):
            say(f"quantize: cached {quant} file {path}, nothing to do")
            return path
        plan = _tensor_plan(spec, ckpt, quant, say)      # checks every shape before anything is written
        os.makedirs(cache_dir, exist_ok=True)
        tmp = os.path.join(cache_dir, f".{key}.{os.getpid()}.tmp")
        try:
            _write_gguf(tmp, model_dir, spec, ckpt, quant, plan, say)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    finally:
        ckpt.close()
    say(f"quantize: wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    return path


def cache_key(model_dir: str, ckpt: Checkpoint, quant: str) -> str:
    h = hashlib.sha256(f"helmc-gguf v{FORMAT_VERSION} {quant}\n".encode())
    for f in ckpt.files:
        with open(f.path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = hashlib.sha256(fh.read(n)).hexdigest()
        h.update(f"{os.path.basename(f.path)} {os.path.getsize(f.path)} {header}\n".encode())
    for name in ("config.json", "model.safetensors.index.json") + _TOKENIZER_FILES:
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            with open(p, "rb") as fh:
                h.update(f"{name} {hashlib.sha256(fh.read()).hexdigest()}\n".encode())
    return h.hexdigest()


# ---- what goes in the file ----------------------------------------------------------------------

def mixed_type(quant: str, hf: str, n_layers: int, n_experts: int = 0) -> str:
    """The block type of linear `hf` under `quant` in a model of n_layers blocks and n_experts routed experts
    (weight_types.QuantMix.type_of)."""
    return quant_mix(quant).type_of(hf, n_layers, n_experts)


def _tensor_plan(spec: ModelSpec, ckpt: Checkpoint, quant: str, say: Progress) -> list[tuple[str, str, str, tuple]]:
    """[(GGUF name, HF source name, helmc type name, logical shape)] in file order; the row permutation of
    llama's q/k is applied when the tensor is written."""
    def linear_type(hf: str, shape) -> str:
        quant_here = mixed_type(quant, hf, spec.num_layers, spec.moe.num_experts if spec.moe else 0)
        return fitting_type(hf, shape, quant_here)

    fallback = quant_mix(quant).fallback

    def fitting_type(hf: str, shape, qtype: str) -> str:
        k = shape[-1]
        for t in (qtype, fallback):
            if k % quant_type(t).block_weights == 0:
                if t != qtype:
                    say(f"quantize: {hf} {list(shape)}: {k} is not a multiple of the {qtype} block "
                        f"({quant_type(qtype).block_weights}), written as {t}")
                return t
        say(f"quantize: {hf} {list(shape)}: {k} is not a multiple of {quant_type(fallback).block_weights}, "
            "written as f16")
        return "f16"

    def entry(hf, kind, expect, source=None):
        shape = tuple(ckpt.info(source or hf).shape)
        if shape != tuple(expect):
            raise HelmcError(f"weights: {source or hf} shape expected {list(expect)} from config.json, found {list(shape)}")
        t = linear_type(hf, shape) if kind == "linear" else kind
        return (gguf_name(hf), source or hf, t, shape)          # gguf_spec's one HF <-> GGUF name table

    H, V = spec.hidden_size, spec.vocab_size
    plan = [entry("model.embed_tokens.weight", "f16", (V, H))]
    for i in range(spec.num_layers):
        for local, shape in spec.block_weight_shapes(i).items():
            hf = f"model.layers.{i}.{local}"
            kind = spec.moe.expert_kind(local) if spec.is_moe_layer(i) else None
            if kind is None:
                plan.append(entry(hf, "linear" if local in _LINEARS else "f32", shape))
            elif local == spec.moe.expert_weight_names(0)[kind]:    # the block's experts of this kind, stacked
                plan.append(_stacked_experts(spec, i, kind, ckpt, linear_type))
    plan.append(entry("model.norm.weight", "f32", (H,)))
    plan.append(entry("lm_head.weight", "linear", (V, H),
                      source="model.embed_tokens.weight" if spec.tie_word_embeddings else None))
    return plan


def _stacked_experts(spec: ModelSpec, layer: int, kind: int, ckpt: Checkpoint, linear_type) -> tuple:
    """The plan entry of block `layer`'s experts of one kind (gate, up, down) as llama.cpp stacks them: one GGUF
    tensor [experts, rows, cols] whose sources are the experts' HF tensors in order; the type is what the mix gives
    the dense weight of the same kind (Q4_K_M's Q6_K ffn_down blocks keep their experts' down in Q6_K too)."""
    moe = spec.moe
    sources = tuple(f"model.layers.{layer}.{moe.expert_weight_names(e)[kind]}" for e in range(moe.num_experts))
    expect = spec.block_weight_shapes(layer)[moe.expert_weight_names(0)[kind]]
    for src in sources:
        if tuple(ckpt.info(src).shape) != tuple(expect):
            raise HelmcError(f"weights: {src} shape expected {list(expect)} from config.json, found "
                             f"{list(ckpt.info(src).shape)}")
    dense = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")[kind]
    t = linear_type(f"model.layers.{layer}.{dense}", expect)
    stem = gguf_name(sources[0])[:-len(".0.weight")]                # blk.N.ffn_gate_exps
    return (f"{stem}.weight", sources, t, (moe.num_experts, *expect))


def _llama_row_order(spec: ModelSpec, name: str, rows: int) -> np.ndarray | None:
    """Row order of llama.cpp's converter for a llama file's attn_q / attn_k (weight and bias): each head's
    RoPE halves interleaved (GGUF row r is HF row order[r]); None for every other tensor."""
    heads = permuted_heads(_GGUF_ARCH[spec.architecture], spec, name)
    return qk_rows_to_gguf(heads, rows // heads) if heads else None


def _float32_rows(view: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":                             # raw bits as uint16: the high half of a float32
        return (view.astype(np.uint32) << 16).view(np.float32)
    return view.astype(np.float32)


def _encode(view: np.ndarray, dtype: str, t: str, order: np.ndarray | None) -> np.ndarray:
    """uint8 [rows, row_bytes] (2-D) or [row_bytes] (1-D) of one tensor, chunk by chunk of rows."""
    qt = quant_type(t)
    v2 = view.reshape(1, -1) if view.ndim == 1 else view          # [rows, k]
    if view.ndim == 1 and order is not None:                       # a permuted bias: one row, reordered
        v2, order = view[order].reshape(1, -1), None
    rows, k = v2.shape
    out = np.empty((rows, qt.row_bytes(k)), dtype=np.uint8)
    step = max(1, _CHUNK_BYTES // (4 * k))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        src = v2[order[r0:r1]] if order is not None else v2[r0:r1]
        out[r0:r1] = quantize(_float32_rows(src, dtype), t)
    return out.reshape(-1) if view.ndim == 1 else out


def _write_gguf(path, model_dir, spec, ckpt, quant, plan, say: Progress) -> None:
    w = gguf.GGUFWriter(path, _GGUF_ARCH[spec.architecture])
    _add_metadata(w, model_dir, spec, quant)
    _add_tokenizer(w, model_dir, spec, say)
    extra = _rope_freqs(spec)
    for name, _src, t, shape in plan:
        qt = quant_type(t)
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * qt.row_bytes(shape[-1])
        # Quantized tensors are declared by their byte shape and type; gguf converts it to the logical shape.
        if qt.is_block_quantized:
            w.add_tensor_info(name, (*shape[:-1], qt.row_bytes(shape[-1])), np.dtype(np.uint8), nbytes, qt.ggml_type)
        else:
            w.add_tensor_info(name, shape, np.dtype({"f16": np.float16, "f32": np.float32}[t]), nbytes)
    if extra is not None:
        w.add_tensor_info("rope_freqs.weight", extra.shape, extra.dtype, extra.nbytes)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with steps(say, f"quantize: {len(plan)} tensors to {quant}", len(plan)) as bar:
            for name, src, t, shape in plan:
                if isinstance(src, tuple):      # stacked experts: each expert's rows, one after another
                    data = np.concatenate([_encode(ckpt.view(e), ckpt.info(e).dtype, t, None) for e in src])
                else:
                    data = _encode(ckpt.view(src), ckpt.info(src).dtype, t, _llama_row_order(spec, name, shape[0]))
                w.write_tensor_data(data)
                del data
                bar.advance()
        if extra is not None:
            w.write_tensor_data(extra)
    finally:
        w.close()


def _add_metadata(w: gguf.GGUFWriter, model_dir: str, spec: ModelSpec, quant: str) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(os.path.basename(os.path.normpath(model_dir)))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType(quant_mix(quant).file_type))
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_freq_base(spec.rope.theta)
    if spec.rope.kind == "yarn" and not (spec.rope.truncate and math.isclose(
            spec.rope.attention_factor, 0.1 * math.log(spec.rope.factor) + 1.0, rel_tol=1e-12)):
        raise HelmcError(f"GGUF writer: YaRN RoPE expected llama.cpp's (truncated ramp, attention factor "
                         f"0.1 ln(factor) + 1), found truncate={spec.rope.truncate}, "
                         f"attention_factor={spec.rope.attention_factor}")
    if spec.rope.kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.rope.factor)
        w.add_rope_scaling_orig_ctx_len(spec.rope.original_max_position)
        w.add_rope_scaling_yarn_beta_fast(spec.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(spec.rope.beta_slow)
    if spec.rope.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope.factor)
    if spec.sliding_window:             # read back where the architecture keeps it (Mixtral's llama with experts)
        w.add_sliding_window(spec.sliding_window)
    if spec.moe is not None:
        w.add_expert_count(spec.moe.num_experts)
        w.add_expert_used_count(spec.moe.top_k)
        w.add_expert_feed_forward_length(spec.moe.expert_intermediate_size)
    if ARCHITECTURES[spec.architecture].gguf_vocab_and_rope_dims:
        w.add_vocab_size(spec.vocab_size)
        w.add_rope_dimension_count(spec.head_dim)


def _rope_freqs(spec: ModelSpec) -> np.ndarray | None:
    """llama3 RoPE as llama.cpp takes it: a rope_freqs tensor of per-frequency divisors (its converter's
    generate_extra_tensors), the base frequencies left to rope.freq_base."""
    r = spec.rope
    if r.kind != "llama3":
        return None
    d = spec.head_dim
    freqs = 1.0 / (r.theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    wavelen = 2 * np.pi / freqs
    lo_wl, hi_wl = r.original_max_position / r.low_freq_factor, r.original_max_position / r.high_freq_factor
    smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    mid = 1 / ((1 - smooth) / r.factor + smooth)
    return np.where(wavelen < hi_wl, 1.0, np.where(wavelen > lo_wl, r.factor, mid)).astype(np.float32)


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: str, spec: ModelSpec, say: Progress) -> None:
    """tokenizer.ggml.* as the converter's gpt2 path writes them: tokens (padded to vocab_size with
    [PADi]), token types, merges, bos/eos ids, add_bos and chat_template (gguf's SpecialVocab reads those
    from tokenizer.json, tokenizer_config.json and config.json, as the converter does)."""
    p = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(p):
        say("quantize: no tokenizer.json, the file has no tokenizer keys")
        return
    with open(p, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model") or {}
    pre = json.dumps(tok.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        say("quantize: tokenizer.json is not a byte-level BPE (gpt2) tokenizer, the file has no tokenizer keys")
        return
    by_id = {i: t for t, i in model.get("vocab", {}).items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(max(spec.vocab_size, max(by_id, default=-1) + 1, max(added, default=-1) + 1)):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_tokenizer_pre(tok, spec, say))
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _tokenizer_pre(tok: dict, spec: ModelSpec, say: Progress) -> str:
    """tokenizer.ggml.pre from tokenizer.json's pre-tokenizer. llama.cpp's converter hashes a test string's
    encoding; here its Split regex is compared with the ones gguf_spec reads back: Qwen2's ("qwen2", every
    Qwen2 / 2.5 / 3 tokenizer) and Llama 3's ("llama-bpe"); a bare ByteLevel splits with GPT-2's ("gpt-2")."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    splits = [p for p in pre.get("pretokenizers") or [] if p.get("type") == "Split"]
    pattern = (splits[0].get("pattern") or {}).get("Regex") if len(splits) == 1 else None
    for name in ("qwen2", "llama-bpe"):
        if pattern is not None and pattern == PRE_TOKENIZERS[name].regex:
            return name
    guess = ARCHITECTURES[spec.architecture].pre_tokenizer
    say(f"quantize: tokenizer.json's pre-tokenizer is neither Qwen2's, Llama 3's nor GPT-2's; written as {guess!r}")
    return guess
