"""GGUF tensor names: llama.cpp's names and Hugging Face's, both ways, from one table (helmc.model.arch.tensors, every
architecture's block; shared with the HF -> GGUF writer), and the per-head row order llama.cpp's llama converter
gives attn_q / attn_k."""
from __future__ import annotations

import re

import numpy as np

from helmc.errors import HelmcError
from helmc.model.arch import ARCHITECTURES, GGUF_ARCHITECTURES as ARCH_BY_GGUF
from helmc.model.arch.tensors import DENSE_BLOCK, EXPERT_STACKS, QK_PERMUTED, ROOT_TENSORS
from helmc.model.moe import NAMINGS
from helmc.model.spec import ModelSpec

HF_TO_GGUF_ROOT = ROOT_TENSORS
# Without Gemma's block, which names the same HF norm otherwise (post_attention_layernorm): its names go by the
# architecture (gguf_name / hf_name's `arch`).
HF_TO_GGUF_BLOCK = {**DENSE_BLOCK, **{h: g for a in ARCHITECTURES.values() if not a.sandwich_norms and all(
    DENSE_BLOCK.get(h, g) == g for h, g in a.block_tensors.items()) for h, g in a.block_tensors.items()}}
GGUF_TO_HF_ROOT = {g: h for h, g in HF_TO_GGUF_ROOT.items()}
GGUF_TO_HF_BLOCK = {g: h for h, g in HF_TO_GGUF_BLOCK.items()}
# The tensors llama.cpp's llama converter reorders per head (see qk_rows_to_hf); which files have them: the arch entry.
PERMUTED_FOR_LLAMA = QK_PERMUTED

_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# One expert's weight: HF model.layers.N.mlp.experts.E.gate_proj.weight (Mixtral: block_sparse_moe.experts.E.w1.weight;
# every naming of helmc.model.moe.NAMINGS) <-> blk.N.ffn_gate_exps.E.weight, the slice E of the file's stacked
# blk.N.ffn_gate_exps.weight (expert_slices names them so). GGUF -> HF takes the file's naming.
# gpt-oss's experts' biases alike: mlp.experts.E.gate_proj.bias <-> blk.N.ffn_gate_exps.E.bias.
_HF_EXPERTS = tuple((re.compile(r"model\.layers\.(\d+)\." + re.escape(t.split("{e}")[0]) + r"(\d+)"
                                + re.escape(t.split("{e}")[1][:-len("weight")]) + r"(weight|bias)"), stack)
                    for _router, templates in NAMINGS.values() for t, stack in zip(templates, EXPERT_STACKS))
_GGUF_EXPERT = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.(\d+)\.(weight|bias)")
GGUF_STACKED = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.(weight|bias)")
GGUF_ROUTER = "ffn_gate_inp.weight"


def _block_names(arch: str | None) -> tuple[dict, dict]:
    """(HF -> GGUF, GGUF -> HF) block suffixes of the architecture `arch` (an HF class; None: the shared table)."""
    if arch is None or arch not in ARCHITECTURES:
        return HF_TO_GGUF_BLOCK, GGUF_TO_HF_BLOCK
    table = ARCHITECTURES[arch].block_tensors
    return table, {g: h for h, g in table.items()}


def gguf_name(hf_name: str, arch: str | None = None) -> str:
    """llama.cpp's name of a Hugging Face parameter name (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight);
    `arch` (the HF class) where its block names the norms its own way (Gemma)."""
    if hf_name in HF_TO_GGUF_ROOT:
        return HF_TO_GGUF_ROOT[hf_name]
    for pattern, stack in _HF_EXPERTS:
        if m := pattern.fullmatch(hf_name):
            return f"blk.{m.group(1)}.{stack}.{m.group(2)}.{m.group(3)}"
    m, block = _HF_BLOCK.fullmatch(hf_name), _block_names(arch)[0]
    if m and m.group(2) in block:
        return f"blk.{m.group(1)}.{block[m.group(2)]}"
    raise HelmcError(f"tensor name: expected a Qwen3/Qwen2/Llama parameter name, found {hf_name!r} (no GGUF equivalent)")


def hf_name(gguf_name: str, naming: str = "qwen_moe", arch: str | None = None) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name (blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight);
    a router's and an expert's under `naming` (a helmc.model.moe.NAMINGS key: the file's architecture's)."""
    if gguf_name in GGUF_TO_HF_ROOT:
        return GGUF_TO_HF_ROOT[gguf_name]
    router, experts = NAMINGS[naming]
    if m := _GGUF_EXPERT.fullmatch(gguf_name):
        local = experts[EXPERT_STACKS.index(m.group(2))].format(e=int(m.group(3)))[:-len("weight")] + m.group(4)
        return f"model.layers.{m.group(1)}.{local}"
    m = _GGUF_BLOCK.fullmatch(gguf_name)
    if m and m.group(2) == GGUF_ROUTER:
        return f"model.layers.{m.group(1)}.{router}"
    block = _block_names(arch)[1]
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}"
    raise HelmcError(f"tensor name: expected a llama.cpp tensor of a qwen3/qwen2/llama model, found {gguf_name!r}")


def qk_rows_to_hf(n_heads: int, head_dim: int) -> np.ndarray:
    """int64 [n_heads * head_dim]: HF row r of a llama file's attn_q / attn_k is GGUF row idx[r].

    llama.cpp's converter (LlamaModel.permute) interleaves each head's two RoPE halves, so GGUF row
    h*D + 2j + i holds HF row h*D + i*D/2 + j: the same rows (also whole quantized rows), reordered."""
    idx = np.arange(n_heads * head_dim, dtype=np.int64).reshape(n_heads, head_dim // 2, 2)  # [h, j, i] = GGUF row
    return np.ascontiguousarray(idx.swapaxes(1, 2)).reshape(-1)                                # [h, i, j] -> HF order


def qk_rows_to_gguf(n_heads: int, head_dim: int) -> np.ndarray:
    """The inverse of qk_rows_to_hf: GGUF row r is HF row idx[r] (what a HF -> GGUF writer applies)."""
    return np.argsort(qk_rows_to_hf(n_heads, head_dim))


def permuted_heads(gguf_arch: str, spec: ModelSpec, gguf_tensor: str) -> int:
    """Heads whose rows llama.cpp permuted in this tensor of a `gguf_arch` file (0: stored in HF order)."""
    m = _GGUF_BLOCK.fullmatch(gguf_tensor)
    entry = ARCH_BY_GGUF.get(gguf_arch)
    kind = entry.permuted_tensors.get(m.group(2)) if m and entry is not None else None
    return {"q": spec.num_heads, "k": spec.num_kv_heads}.get(kind, 0)

