"""The weight-type registry: every type helmc stores weights in, and every `--quant` mix, in one table each.

A weight type is what a tensor is stored as: a plain float type (f32, f16, bf16) or one of llama.cpp's block
formats (GGUF). Everything other modules need to know about one is here, and they ask this table rather than
compare names: its block geometry (weights per block, bytes per block: a row of k weights is k / block_weights
blocks), its GGUF type id, the NumPy quantizer of its blocks, the kernels that read it (by reference,
"module:function", resolved on first use so that importing this table imports no compiler), the profile kit's
launches, and the GPU decode GEMV's tunings.

To add a block type: one WeightType entry below, its block quantizer in `quant_formats.py`, and its kernels
(`schedules/cpu/gemv_quant.py` / `schedules/cpu/quant/`, `schedules/gpu/quant_gemv.py`), whose per-format
tables are keyed by the type's name.

This module imports nothing but the standard library and helmc.errors: the runtime reads it too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from helmc.errors import HelmcError

# The GPU decode GEMV's (rows per warp, warps, unroll) with a SwiGLU epilogue over the int8-activation GEMV
# (two weights' rows per warp); the residual epilogue keeps the type's own gpu_int8_tuning.
GPU_INT8_SWIGLU_TUNING = (1, 8, 2)
GPU_INT8_EPILOGUES = ("swiglu", "residual")


@dataclass(frozen=True)
class WeightType:
    name: str                        # helmc's name, GGUF's type name in lower case
    ggml_id: int                     # GGUF's tensor type id (gguf.GGMLQuantizationType)
    block_weights: int               # weights per block (1 for the plain float types)
    block_bytes: int                 # bytes per block
    dtype: str = ""                  # a plain float type: its dtype name (float16, ...); "": a block format
    # The NumPy quantizer of a block format: f([blocks, block_weights] float32) -> uint8 [blocks, block_bytes].
    block_quantizer: str = ""
    # The decode GEMV makers (make_gemv_quant(qtype, n, k, isa, m=m); make_gpu_gemv_quant(qtype, n, k, *tuning, m=m)).
    cpu_gemv: str = ""
    gpu_gemv: str = ""
    gpu_gemv_tuning: tuple[int, ...] = ()      # (rows per warp, warps, unroll) of gpu_gemv
    # The GPU decode GEMV over int8 activations (dp4a; its epilogues fuse a block's launches as the float GEMVs',
    # so the profile kit measures the fused launches); "": none, gpu_gemv serves every decode linear.
    gpu_gemv_int8: str = ""
    gpu_int8_tuning: tuple[int, ...] = ()
    kit: bool = False                # the profile kit measures helmc's GEMVs of this type

    @property
    def is_block_quantized(self) -> bool:
        return self.block_weights > 1

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_weights

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights; k must be a whole number of blocks."""
        if k % self.block_weights:
            raise HelmcError(f"{self.name}: a row of {k} weights is not a multiple of the block size {self.block_weights}")
        return k // self.block_weights * self.block_bytes

    def tensor_bytes(self, elements: int) -> int:
        return elements // self.block_weights * self.block_bytes

    def gpu_epilogue_tuning(self, epilogue: str) -> tuple[int, ...]:
        """The int8 GEMV's tuning with `epilogue` (swiglu | residual)."""
        return GPU_INT8_SWIGLU_TUNING if epilogue == "swiglu" else self.gpu_int8_tuning

    def maker(self, kind: str) -> Callable:
        """The kernel maker `kind` (cpu_gemv | gpu_gemv | gpu_gemv_int8 | block_quantizer), imported on first use."""
        ref = getattr(self, kind)
        if not ref:
            raise HelmcError(f"weight type {self.name}: no {kind} expected to be asked for, none registered")
        return resolve(ref)


_CPU_GEMV = "helmc.schedules.cpu.quant.decode_gemv:make_gemv_quant"
_GPU_GEMV = "helmc.schedules.gpu.quant_gemv:make_gpu_gemv_quant"
_GPU_GEMV_INT8 = "helmc.schedules.gpu.quant_gemv_int8:make_gpu_gemv_int8"
_QUANT = "helmc.model.quant_formats"

# GPU tunings: the fastest timed on the H100 (benchmarks/bench_quant_gemv_gpu.py, bench_gemv_gpu.py;
# artifacts/bench/device-2026-11-24-s7/call5 and device-2026-11-27-s15): the int8 GEMV ~1 issue slot per weight
# instead of ~5.5, 4096x12288 Q4_K 18.4 us at (2, 8, 2) against 20.3 at (2, 4, 2) and 25.3 for the fp32 path.
# q5_k / q3_k take q4_k's / q6_k's int8 tuning (the same lanes and runs; not yet timed apart).
WEIGHT_TYPES: dict[str, WeightType] = {t.name: t for t in (
    WeightType("f32", 0, 1, 4, dtype="float32"),
    WeightType("f16", 1, 1, 2, dtype="float16", kit=True),
    WeightType("bf16", 30, 1, 2, dtype="bfloat16", kit=True),
    WeightType("q8_0", 8, 32, 34, block_quantizer=f"{_QUANT}:q8_0_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), kit=True),
    WeightType("q4_0", 2, 32, 18, block_quantizer=f"{_QUANT}:q4_0_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), kit=True),
    WeightType("q5_0", 6, 32, 22, block_quantizer=f"{_QUANT}:q5_0_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), kit=True),
    WeightType("q3_k", 11, 256, 110, block_quantizer=f"{_QUANT}:q3_k_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), gpu_gemv_int8=_GPU_GEMV_INT8, gpu_int8_tuning=(2, 8, 2), kit=True),
    WeightType("q4_k", 12, 256, 144, block_quantizer=f"{_QUANT}:q4_k_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(2, 4, 4), gpu_gemv_int8=_GPU_GEMV_INT8, gpu_int8_tuning=(2, 8, 2), kit=True),
    WeightType("q5_k", 13, 256, 176, block_quantizer=f"{_QUANT}:q5_k_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), gpu_gemv_int8=_GPU_GEMV_INT8, gpu_int8_tuning=(2, 8, 2), kit=True),
    WeightType("q6_k", 14, 256, 210, block_quantizer=f"{_QUANT}:q6_k_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), gpu_gemv_int8=_GPU_GEMV_INT8, gpu_int8_tuning=(2, 8, 2), kit=True),
    WeightType("iq4_xs", 23, 256, 136, block_quantizer="helmc.model.quant_iq4:iq4_xs_blocks", cpu_gemv=_CPU_GEMV,
               gpu_gemv=_GPU_GEMV, gpu_gemv_tuning=(1, 4, 4), kit=True),
    # OCP microscaling FP4 (gpt-oss's experts): 17-byte blocks, so rows are only byte-aligned.
    WeightType("mxfp4", 39, 32, 17, block_quantizer=f"{_QUANT}:mxfp4_blocks", cpu_gemv=_CPU_GEMV, gpu_gemv=_GPU_GEMV,
               gpu_gemv_tuning=(1, 4, 4), kit=True),
)}

# Views of the table the other modules ask for, in the table's order.
BLOCK_TYPES = tuple(n for n, t in WEIGHT_TYPES.items() if t.is_block_quantized)
FLOAT_TYPES = tuple(n for n, t in WEIGHT_TYPES.items() if not t.is_block_quantized)
GPU_INT8_TYPES = tuple(n for n, t in WEIGHT_TYPES.items() if t.gpu_gemv_int8)
# The profile kit names float weights by their dtype (float16, ...), block formats by their name.
KIT_FLOAT_DTYPES = tuple(t.dtype for t in WEIGHT_TYPES.values() if t.kit and not t.is_block_quantized)
KIT_BLOCK_TYPES = tuple(n for n, t in WEIGHT_TYPES.items() if t.kit and t.is_block_quantized)


def weight_type(name: str, who: str = "weight type") -> WeightType:
    t = WEIGHT_TYPES.get(name)
    if t is None:
        raise HelmcError(f"{who}: expected one of {', '.join(WEIGHT_TYPES)}, found {name!r}")
    return t


def block_type(name: str, who: str = "weight type") -> WeightType:
    """A block format's entry (a HelmcError naming the block formats for anything else)."""
    t = WEIGHT_TYPES.get(name)
    if t is None or not t.is_block_quantized:
        raise HelmcError(f"{who}: weight type expected one of {tuple(BLOCK_TYPES)}, found {name!r}")
    return t


def quant_blocks() -> dict[str, tuple[int, int]]:
    """{block format: (weights, bytes) per block}."""
    return {n: (WEIGHT_TYPES[n].block_weights, WEIGHT_TYPES[n].block_bytes) for n in BLOCK_TYPES}


def resolve(ref: str) -> Callable:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


# ---- `--quant`: how a Hugging Face checkpoint's weights are quantized --------------------------------------

def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the first and last eighth of the blocks and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


# Which blocks a LinearRule covers: f(layer, n_layers) -> bool, as llama_tensor_get_type picks them.
BLOCK_SELECTIONS: dict[str, Callable[[int, int], bool]] = {
    "all": lambda layer, n: True,
    "more_bits": use_more_bits,
    "first_two": lambda layer, n: layer < 2,                 # Q3_K_M's attn_v (i_attention_wv < 2)
    "first_sixteenth": lambda layer, n: layer < n // 16,     # Q3_K_M's ffn_down
}
_ATTN_V, _ATTN_OUT, _FFN_DOWN = "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"
_ATTN_K = "self_attn.k_proj.weight"


@dataclass(frozen=True)
class LinearRule:
    """In a mix: the linears `linears` (HF names inside a block) of the blocks `blocks` (a BLOCK_SELECTIONS key)
    are stored as `type`."""
    linears: tuple[str, ...]
    type: str
    blocks: str = "all"


# llama.cpp's bumps for a model of exactly 8 experts (Mixtral: "trades just ~128MB"), ahead of a mix's own rules:
# attn_k and attn_v in Q8_0 whatever the file type; attn_output in Q5_K for the Q3_K and Q4_K files.
EIGHT_EXPERTS = 8
_EIGHT_EXPERT_KV = LinearRule((_ATTN_K, _ATTN_V), "q8_0")
_K34 = (_EIGHT_EXPERT_KV, LinearRule((_ATTN_OUT,), "q5_k"))    # the Q3_K and Q4_K files' (S and M)


@dataclass(frozen=True)
class QuantMix:
    """A `helmc build --quant` choice: the block type of the linears, llama.cpp's file type it is written as, and
    for a mix (llama.cpp's _M) the type of the lm_head and the rules that give some blocks' linears more bits
    (the first rule that covers a linear wins). A linear whose k is not a whole number of blocks falls back to
    `fallback` (where k is a multiple of its block), else f16."""
    name: str
    linear_type: str
    file_type: int                   # gguf.LlamaFileType
    head_type: str = ""              # "": linear_type
    rules: tuple[LinearRule, ...] = ()
    fallback: str = "q8_0"
    eight_expert_rules: tuple[LinearRule, ...] = (_EIGHT_EXPERT_KV,)    # first, in a model of EIGHT_EXPERTS experts

    def type_of(self, hf: str, n_layers: int, n_experts: int = 0) -> str:
        """The block type of linear `hf` (an HF name) in a model of n_layers blocks and n_experts routed experts."""
        if hf == "lm_head.weight" and self.head_type:
            return self.head_type
        layer, _, local = hf.removeprefix("model.layers.").partition(".")
        for rule in (self.eight_expert_rules if n_experts == EIGHT_EXPERTS else ()) + self.rules:
            if local in rule.linears and BLOCK_SELECTIONS[rule.blocks](int(layer), n_layers):
                return rule.type
        return self.linear_type

    @property
    def types(self) -> tuple[str, ...]:
        """Every block type the mix writes."""
        return tuple(dict.fromkeys((self.linear_type, self.head_type or self.linear_type, self.fallback)
                                   + tuple(r.type for r in self.rules + self.eight_expert_rules)))


QUANT_MIXES: dict[str, QuantMix] = {m.name: m for m in (
    QuantMix("q8_0", "q8_0", 7),
    QuantMix("q4_0", "q4_0", 2),
    QuantMix("q3_k", "q3_k", 11, eight_expert_rules=_K34),     # llama.cpp's MOSTLY_Q3_K_S
    # llama.cpp's Q3_K_M for dense models: attn_v Q5_K in the first two blocks and Q4_K after; ffn_down Q5_K in
    # the first sixteenth and Q4_K after (the Q3_K branch is Falcon's only); attn_output Q4_K; output Q6_K.
    QuantMix("q3_k_m", "q3_k", 12, head_type="q6_k", rules=(
        LinearRule((_ATTN_V,), "q5_k", "first_two"), LinearRule((_FFN_DOWN,), "q5_k", "first_sixteenth"),
        LinearRule((_ATTN_V, _FFN_DOWN, _ATTN_OUT), "q4_k")), eight_expert_rules=_K34),
    QuantMix("q4_k", "q4_k", 14, eight_expert_rules=_K34),     # llama.cpp's MOSTLY_Q4_K_S ("mostly Q4_K": display only)
    QuantMix("q4_k_m", "q4_k", 15, head_type="q6_k", rules=(LinearRule((_ATTN_V, _FFN_DOWN), "q6_k", "more_bits"),),
             eight_expert_rules=_K34),
    QuantMix("q5_k", "q5_k", 16),          # llama.cpp's MOSTLY_Q5_K_S
    QuantMix("q5_k_m", "q5_k", 17, head_type="q6_k", rules=(LinearRule((_ATTN_V, _FFN_DOWN), "q6_k", "more_bits"),)),
)}


def quant_mix(name: str, who: str = "quantize") -> QuantMix:
    m = QUANT_MIXES.get(name)
    if m is None:
        raise HelmcError(f"{who}: type expected one of {', '.join(QUANT_MIXES)}, found {name!r}")
    return m
