"""ModelSpec: what helmc needs to know about a decoder-only transformer, read from config.json.

A build needs this file only; weights bind at run time. Supported: the architectures of helmc.model.arch (Qwen3,
Qwen2, Llama, Mistral, and the mixtures of experts Qwen3-MoE and Mixtral, whose router and experts' layout
helmc/model/moe.py reads), which says what differs between them. Everything the compiler, the cost model and the runtime
derive from the architecture (bytes per block, head layout, RoPE frequencies) comes from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.jsonio import from_dict, load_json_file, parse_json, to_dict
from helmc.model.arch import ARCHITECTURES
from helmc.model.moe import MoeSpec, moe_from_hf_config
from helmc.model.weight_types import quant_blocks

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")   # the MLP's gate activation (SwiGLU, GeGLU)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Far above any released model (Llama 3.1 405B: 126 blocks, hidden 16384, 128 heads; vocabularies ~256k), but
# below what a corrupt header can ask for: the checks that list one tensor per block, or the planner's tables,
# must never be sized by a 2^31 taken from a file.
SIZE_LIMITS = {"hidden_size": 1 << 18, "intermediate_size": 1 << 20, "num_layers": 4096, "num_heads": 4096,
               "num_kv_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 30}
# The block's linear weights, in the order ModelSpec.layer_types lists their types.
LINEAR_NAMES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# Weights of one block of each quantized type and its bytes (llama.cpp's formats, GGUF): weight_types' table.
QUANT_BLOCKS = quant_blocks()


def check_quant_shape(qtype: str, n: int, k: int, who: str) -> tuple[int, int]:
    """(weights, bytes) of `qtype`'s block, after checking that an [n, k] weight is whole blocks along k: the
    kernels' one check, its HelmcError prefixed by `who`."""
    if qtype not in QUANT_BLOCKS:
        raise HelmcError(f"{who}: weight type expected one of {tuple(QUANT_BLOCKS)}, found {qtype!r}")
    weights, nbytes = QUANT_BLOCKS[qtype]
    if k < 1 or k % weights:
        raise HelmcError(f"{who}: {qtype} k expected a positive multiple of its {weights}-weight block, found k={k}")
    if n < 1:
        raise HelmcError(f"{who}: n expected >= 1, found n={n}")
    return weights, nbytes
_TORCH_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                      "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"            # "default" | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0     # llama3 only
    high_freq_factor: float = 1.0    # llama3 only
    original_max_position: int = 0   # llama3 and yarn
    # yarn only: the ramp between interpolated and extrapolated frequencies (rotations beta_fast..beta_slow over
    # the original context, its ends rounded outwards when truncate), and the factor cos and sin are scaled by.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str                        # weight dtype in the checkpoint: float32 | float16 | bfloat16
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int = 0           # 0: none
    bos_token_id: int = -1
    eos_token_ids: tuple[int, ...] = ()
    # Quantized weights (a GGUF file, or `helmc build --quant`): per block, the type of each LINEAR_NAMES weight
    # (a weight_types block format, or "" for `dtype`); the lm_head's and the token embedding's types. Empty: all in `dtype`.
    # Norms and biases are always in `dtype`.
    layer_types: tuple[tuple[str, ...], ...] = ()
    head_type: str = ""
    embed_type: str = ""
    # Mixture of experts (helmc/model/moe.py): the router and expert layout; None for a dense model.
    moe: MoeSpec | None = None
    # Quantized experts: per block, the (gate, up, down) types of its experts (every expert of a block has its
    # block's: a GGUF file stacks them in one tensor per kind); ("", "", "") for a dense block. Empty: float experts.
    expert_types: tuple[tuple[str, str, str], ...] = ()
    # Gemma's block (helmc.model.arch's features of the same names): RMSNorm scales by (norm_offset + w); norms on
    # the attention and MLP outputs before each residual add; the MLP's activation; token embeddings times
    # embed_scale (rounded to the weight dtype); attention scores times attn_scale (0: head_dim ** -0.5).
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"          # silu | gelu_pytorch_tanh
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    # Blocks that attend globally though sliding_window is set (Gemma 3's every sixth); empty: all use the window.
    global_layers: tuple[int, ...] = ()
    # The RoPE of the sliding-window blocks where it differs from `rope` (Gemma 3's base 10000); None: all use `rope`.
    local_rope: RopeSpec | None = None
    # gpt-oss's attention: o_proj's bias; a learned logit per query head in each softmax's denominator
    # (self_attn.sinks [num_heads], handed to the KV cache, not to a compiled function).
    o_bias: bool = False
    attn_sinks: bool = False

    def __post_init__(self):
        # A spec also arrives from a bundle's model_spec.json: every number the runtime sizes memory by is checked.
        for name, most in SIZE_LIMITS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > most:
                raise HelmcError(f"model spec: {name} expected a positive integer of at most {most}, found {v!r}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise HelmcError(f"model spec: num_heads ({self.num_heads}) expected a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) and head_dim ({self.head_dim}) even")
        if self.dtype not in DTYPE_BYTES:
            raise HelmcError(f"model spec: dtype expected one of {sorted(DTYPE_BYTES)}, found {self.dtype!r}")
        if self.sliding_window < 0:
            raise HelmcError(f"model spec: sliding_window expected >= 0, found {self.sliding_window}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise HelmcError(f"model spec: hidden_act expected one of {HIDDEN_ACTS}, found {self.hidden_act!r:.60}")
        if any(not 0 <= i < self.num_layers for i in self.global_layers) or \
                list(self.global_layers) != sorted(set(self.global_layers)):
            raise HelmcError(f"model spec: global_layers expected increasing block indices below {self.num_layers}, "
                             f"found {str(self.global_layers)[:80]}")
        quant = set(QUANT_BLOCKS) | {""}
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(len(t) != len(LINEAR_NAMES) for t in self.layer_types)
                                 or any(x not in quant for t in self.layer_types for x in t)):
            raise HelmcError(f"model spec: layer_types expected {self.num_layers} lists of {len(LINEAR_NAMES)} types "
                             f"from {sorted(quant)}, found {str(self.layer_types)[:80]}")
        if self.moe is not None:
            if self.moe.dense_layers and self.moe.dense_layers[-1] >= self.num_layers:
                raise HelmcError(f"model spec: moe dense_layers expected indices below {self.num_layers}, found "
                                 f"{self.moe.dense_layers[-1]}")
        if self.expert_types and (self.moe is None or len(self.expert_types) != self.num_layers
                                  or any(len(t) != 3 or any(x not in quant for x in t) for t in self.expert_types)):
            raise HelmcError(f"model spec: expert_types expected, for a mixture of experts, {self.num_layers} "
                             f"(gate, up, down) types from {sorted(quant)}, found {str(self.expert_types)[:80]}")
        if self.head_type not in quant or self.embed_type not in quant:
            raise HelmcError(f"model spec: head_type and embed_type expected one of {sorted(quant)}, found "
                             f"{self.head_type!r}, {self.embed_type!r}")

    # ---- quantized weights ------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return bool(self.layer_types or self.head_type or self.embed_type or self.expert_types)

    def expert_signatures(self) -> tuple[tuple[str, str, str], ...]:
        """The distinct (gate, up, down) expert types of the routed blocks, in order of first use: one compiled
        expert function each. Float experts: one, all ""."""
        if not self.expert_types:
            return (("", "", ""),)
        sigs = tuple(dict.fromkeys(self.expert_types[i] for i in range(self.num_layers) if self.is_moe_layer(i)))
        return sigs or (("", "", ""),)

    def expert_signature_index(self, layer: int) -> int:
        return self.expert_signatures().index(self.expert_types[layer]) if self.expert_types else 0

    def block_signatures(self) -> tuple[tuple[str, ...], ...]:
        """The distinct per-block type signatures, in order of first use; one compiled block function each
        (a Q4_K_M file has two: some blocks keep v and down in Q6_K). Unquantized: one, all ""."""
        if not self.layer_types:
            return (("",) * len(LINEAR_NAMES),)
        return tuple(dict.fromkeys(self.layer_types))

    def signature_index(self, layer: int) -> int:
        return self.block_signatures().index(self.layer_types[layer]) if self.layer_types else 0

    def weight_type(self, layer: int, name: str) -> str:
        """Type of block `layer`'s weight `name` (relative to model.layers.{i}.): a QUANT_BLOCKS key or ""."""
        if self.expert_types and self.moe is not None and (kind := self.moe.expert_kind(name)) is not None:
            return self.expert_types[layer][kind]
        if not self.layer_types or name not in LINEAR_NAMES:
            return ""
        return self.layer_types[layer][LINEAR_NAMES.index(name)]

    def tensor_bytes(self, shape: tuple[int, ...], qtype: str) -> int:
        n = 1
        for d in shape:
            n *= d
        if not qtype:
            return n * self.dtype_bytes
        weights, block = QUANT_BLOCKS[qtype]
        return n // weights * block

    def block_weight_bytes(self, layer: int) -> int:
        """Bytes of block `layer`'s weights as stored (quantized linears at their block size)."""
        return sum(self.tensor_bytes(shape, self.weight_type(layer, name))
                   for name, shape in self.block_weight_shapes(layer).items())

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_units(self) -> int:
        """Partition units: embedding, one per block, final norm + lm_head (thesis 4.1.1)."""
        return self.num_layers + 2

    @property
    def attention_scale(self) -> float:
        """The factor of q . k in attention: config's query_pre_attn_scalar ** -0.5 (Gemma) or head_dim ** -0.5."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_window(self, layer: int) -> int:
        """Block `layer`'s sliding attention window in tokens (0: it attends to the whole context)."""
        return 0 if layer in self.global_layers else self.sliding_window

    def layer_rope_local(self, layer: int) -> bool:
        """Whether block `layer` takes the local RoPE table (the second half of RopeTables' rows)."""
        return self.local_rope is not None and self.layer_window(layer) > 0

    @property
    def rope_width(self) -> int:
        """Columns of a RoPE table row (runtime/rope.RopeTables): head_dim, or with a local RoPE the global table's
        head_dim then the local one's (each block takes its half: runtime/rope.block_rope)."""
        return self.head_dim * (2 if self.local_rope is not None else 1)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s feed-forward is routed through experts (moe.py) rather than a dense MLP."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def fused_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """{fused parameter name under model.layers.N.: ((block name, rows), ...) in row order} for an architecture
        whose checkpoint stores q/k/v and gate/up fused (Phi-3); empty for the others."""
        if not ARCHITECTURES[self.architecture].fused_projections:
            return {}
        I, Q, KV = self.intermediate_size, self.q_dim, self.kv_dim
        return {"self_attn.qkv_proj.weight": (("self_attn.q_proj.weight", Q), ("self_attn.k_proj.weight", KV),
                                              ("self_attn.v_proj.weight", KV)),
                "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", I), ("mlp.up_proj.weight", I))}

    def block_weight_shapes(self, layer: int | None = None) -> dict[str, tuple[int, ...]]:
        """HF parameter names under `model.layers.{i}.` and their shapes, in the order the compiled
        block functions take them. For a MoE block (`layer` given and routed), the router and experts replace
        the dense MLP; without `layer`, a dense block's."""
        H, I, Q, KV, D = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.head_dim
        s = {"input_layernorm.weight": (H,),
             "self_attn.q_proj.weight": (Q, H), "self_attn.k_proj.weight": (KV, H),
             "self_attn.v_proj.weight": (KV, H)}
        if self.qkv_bias:
            s.update({"self_attn.q_proj.bias": (Q,), "self_attn.k_proj.bias": (KV,), "self_attn.v_proj.bias": (KV,)})
        if self.qk_norm:
            s.update({"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
        s.update({"self_attn.o_proj.weight": (H, Q), "post_attention_layernorm.weight": (H,)})
        if self.o_bias:
            s["self_attn.o_proj.bias"] = (H,)
        if self.attn_sinks:
            s["self_attn.sinks"] = (self.num_heads,)
        if self.sandwich_norms:
            s.update({"pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,)})
        s.update({"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)})
        if layer is not None and self.is_moe_layer(layer):
            dense = self.post_attn_weight_names()
            for name in dense[dense.index("post_attention_layernorm.weight") + 1:]:
                del s[name]
            s.update(self.moe.layer_weight_shapes(H))
        return s

    def pre_attn_weight_names(self) -> tuple[str, ...]:
        """Weights of the compiled pre_attn function, in its parameter order (export and runtime both use this)."""
        names = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        if self.qkv_bias:
            names += ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
        if self.qk_norm:
            names += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        return names

    def post_attn_weight_names(self, layer: int | None = None) -> tuple[str, ...]:
        """The compiled post-attention function's weights; for a MoE block (`layer` routed), post_moe's
        (o_proj, the norm, the router), its experts bound apart (runtime/moe_experts.py)."""
        o = ("self_attn.o_proj.weight",) + (("self_attn.o_proj.bias",) if self.o_bias else ())
        if layer is not None and self.is_moe_layer(layer):
            bias = (self.moe.router_bias_name,) if self.moe.router_bias else ()
            return o + ("post_attention_layernorm.weight", self.moe.router_name) + bias
        norms = ("post_attention_layernorm.weight",) + (
            ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight") if self.sandwich_norms else ())
        return o + norms + ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")

    def head_weight_names(self) -> tuple[str, str]:
        """Checkpoint names (from the model root) of the head function's weights."""
        return ("model.norm.weight", "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight")

    def block_param_count(self) -> int:
        n = 0
        for shape in self.block_weight_shapes().values():
            c = 1
            for d in shape:
                c *= d
            n += c
        return n

    # ---- identity ----------------------------------------------------------------------------
    def architecture_hash(self) -> str:
        """Hash of what the compiled code depends on (shapes, dtype, op variants), not of token ids."""
        d = _set_fields(self)
        for k in ("bos_token_id", "eos_token_ids", "max_position_embeddings"):
            d.pop(k, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        return from_dict(cls, parse_json(text, "model spec"), "model spec")

    # ---- reading a Hugging Face config.json ----------------------------------------------------
    @classmethod
    def from_model_dir(cls, path: str) -> "ModelSpec":
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(cfg_path):
            raise HelmcError(f"model config: expected {cfg_path} (a Hugging Face config.json), found nothing")
        return cls.from_hf_config(load_json_file(cfg_path, "model config"), cfg_path)

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "ModelSpec":
        """Every value is checked for its type here: config.json comes from anywhere (a download, a hand edit)."""
        fields = _hf_config_fields(cfg, where)
        try:
            return cls(**fields)
        except HelmcError as e:              # ModelSpec's own checks (sizes, heads): say which file they are about
            raise HelmcError(f"{where}: {e}") from None


def _hf_config_fields(cfg: dict, where: str) -> dict:
    """ModelSpec's fields from a Hugging Face config.json (ModelSpec.from_hf_config), every value checked."""
    if not isinstance(cfg, dict):
        raise HelmcError(f"{where}: expected a JSON object, found {type(cfg).__name__}")
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HelmcError(f"{where}: architectures expected one of {list(SUPPORTED_ARCHITECTURES)}, found {archs or 'none'}"
                         f"{_CUSTOM_CODE if cfg.get('auto_map') else ''}")
    auto = cfg.get("auto_map")
    if isinstance(auto, dict) and any(k in auto for k in ("AutoModel", "AutoModelForCausalLM")) or \
            (auto is not None and not isinstance(auto, dict)):
        raise HelmcError(f"{where}: expected a {arch} config without custom model code, found auto_map "
                         f"{str(auto)[:80]}{_CUSTOM_CODE}")

    def number(key, default=None, kind=int, positive=True):
        v = cfg.get(key)
        if v is None:
            if default is None:
                raise HelmcError(f"{where}: required key {key!r} missing for {arch}")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) \
                or (positive and v <= 0) or v != v or abs(v) == float("inf"):
            raise HelmcError(f"{where}: {key!r} expected a {'positive ' if positive else ''}"
                             f"{'integer' if kind is int else 'number'}, found {v!r:.60}")
        return kind(v)

    H, heads = number("hidden_size"), number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    head_dim = number("head_dim", max(1, H // heads))
    if heads % kv_heads:
        raise HelmcError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise HelmcError(f"{where}: head_dim must be even for RoPE, found {head_dim}")
    dtype_name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype_name not in _TORCH_DTYPE_NAMES:
        raise HelmcError(f"{where}: dtype expected float32, float16 or bfloat16, found {dtype_name!r:.60}")
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
        raise HelmcError(f"{where}: eos_token_id expected an integer or a list of them, found {cfg['eos_token_id']!r:.60}")
    entry = ARCHITECTURES[arch]
    act_key = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"
    act = cfg.get(act_key, "gelu_pytorch_tanh" if entry.scaled_embeddings else "silu")
    if act not in HIDDEN_ACTS:
        raise HelmcError(f"{where}: {act_key} expected one of {HIDDEN_ACTS}, found {act!r:.60}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):   # Gemma 2's, not built
        if cfg.get(key) is not None:
            raise HelmcError(f"{where}: {key} expected null (no softcapping), found {cfg[key]!r:.60}")
    sliding = 0
    if entry.sliding_window or cfg.get("use_sliding_window") is True:
        sliding = number("sliding_window", 0, positive=False)
    gemma = gemma_fields(cfg, entry, number("num_hidden_layers"), H, sliding, where) if entry.local_rope else {}
    if entry.alternating_layers and not entry.local_rope:
        gemma = dict(global_layers=global_layers(cfg, number("num_hidden_layers"), sliding, entry.alternating_layers,
                                                 where))
    bos = cfg.get("bos_token_id")
    fields = dict(
        architecture=arch, hidden_size=H, intermediate_size=number("intermediate_size"),
        num_layers=number("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=number("vocab_size"),
        rms_norm_eps=number("rms_norm_eps", 1e-6, float), rope=_rope_from_config(cfg, where),
        max_position_embeddings=number("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings") is True,
        dtype=_TORCH_DTYPE_NAMES[dtype_name],
        qkv_bias=entry.qkv_bias or cfg.get("attention_bias") is True,
        qk_norm=entry.qk_norm, sliding_window=sliding,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else -1,
        eos_token_ids=tuple(eos), moe=moe_from_hf_config(cfg, arch, number("num_hidden_layers"), where),
        hidden_act=act, norm_offset=entry.norm_offset, sandwich_norms=entry.sandwich_norms,
        o_bias=entry.o_bias and (entry.qkv_bias or cfg.get("attention_bias") is True), attn_sinks=entry.attn_sinks)
    fields.update(gemma)
    return fields


_CUSTOM_CODE = " (auto_map: custom model code, which helmc never imports or runs: it compiles its own implementation " \
               "of the supported architectures)"


_LAYER_KINDS = ("sliding_attention", "full_attention")


def gemma_fields(cfg: dict, entry, layers: int, hidden: int, sliding: int, where: str) -> dict:
    """Gemma 3's ModelSpec fields from its config.json: which blocks attend globally (layer_types, or every
    sliding_window_pattern-th), the two RoPEs (transformers >= 5 nests them per layer kind in rope_parameters;
    older files give rope_theta + rope_scaling for the global ones and rope_local_base_freq for the sliding ones),
    the attention and embedding scales."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and all(k in params for k in _LAYER_KINDS):
        rope = _rope_from_config({"rope_parameters": params["full_attention"]}, where)
        local = _rope_from_config({"rope_parameters": params["sliding_attention"]}, where)
    else:
        rope = _rope_from_config(cfg, where)
        local = _rope_from_config({"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}, where)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not 0 < scalar < float("inf"):
        raise HelmcError(f"{where}: query_pre_attn_scalar expected a positive number, found {scalar!r:.60}")
    return dict(rope=rope, local_rope=local, attn_scale=float(scalar) ** -0.5,
                global_layers=global_layers(cfg, layers, sliding, 6, where),
                embed_scale=float(hidden) ** 0.5 if entry.scaled_embeddings else 1.0)


def global_layers(cfg: dict, layers: int, sliding: int, pattern: int, where: str) -> tuple[int, ...]:
    """The blocks that attend to the whole context: config.json's layer_types' full_attention ones, else every
    sliding_window_pattern-th (default `pattern`: Gemma 3's 6, gpt-oss's 2)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", pattern))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise HelmcError(f"{where}: sliding_window_pattern expected a positive integer, found {pattern!r:.60}")
        kinds = [_LAYER_KINDS[(i + 1) % pattern == 0] for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in _LAYER_KINDS for k in kinds):
        raise HelmcError(f"{where}: layer_types expected {layers} of {_LAYER_KINDS}, found {str(kinds)[:80]}")
    if sliding < 1 and "sliding_attention" in kinds:
        raise HelmcError(f"{where}: sliding_window expected a positive integer for sliding_attention layers, "
                         f"found {cfg.get('sliding_window')!r:.60}")
    return tuple(i for i, k in enumerate(kinds) if k == "full_attention")


def _rope_from_config(cfg: dict, where: str) -> RopeSpec:
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs use rope_theta +
    # rope_scaling. Both spellings are accepted.
    params = {}
    for key in ("rope_scaling", "rope_parameters"):
        v = cfg.get(key)
        if v is not None and not isinstance(v, dict):
            raise HelmcError(f"{where}: {key} expected a JSON object, found {v!r:.60}")
        params.update(v or {})

    def num(key, default=None, d=params, kind=float):
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf") or v <= 0:
            raise HelmcError(f"{where}: rope {key} expected a positive number, found "
                             f"{'nothing' if v is None else repr(v)[:60]}")
        return kind(v)
    theta = num("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:       # RoPE over a head's first part only (Phi-4-mini's 0.75): not built
        raise HelmcError(f"{where}: rope partial_rotary_factor expected 1.0 (RoPE over the whole head), found {partial!r:.60}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=num("factor"))
    if kind == "llama3":
        return RopeSpec(theta=theta, kind="llama3", factor=num("factor"), low_freq_factor=num("low_freq_factor"),
                        high_freq_factor=num("high_freq_factor"),
                        original_max_position=num("original_max_position_embeddings", kind=int))
    if kind == "yarn":
        return _yarn_rope(params, theta, num, cfg.get("max_position_embeddings"), where)
    raise HelmcError(f"{where}: rope type expected default, linear, llama3 or yarn, found {kind!r:.60}")


def _yarn_rope(params: dict, theta: float, num, max_positions, where: str) -> RopeSpec:
    """YaRN's values as transformers reads them: factor (else max_position_embeddings over the original), beta_fast
    32 and beta_slow 1 where absent, and attention_factor, where absent, 0.1 ln(factor) + 1 (DeepSeek's mscale over
    mscale_all_dim where both are given)."""
    old = num("original_max_position_embeddings", kind=int)
    factor = num("factor") if params.get("factor") is not None else num("max_position_embeddings", max_positions) / old
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HelmcError(f"{where}: rope truncate expected true or false, found {truncate!r:.60}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if params.get("attention_factor") is not None:
        attention = num("attention_factor")
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention = float(mscale(factor, num("mscale")) / mscale(factor, num("mscale_all_dim")))
    else:
        attention = mscale(factor)
    return RopeSpec(theta=theta, kind="yarn", factor=factor, original_max_position=old,
                    beta_fast=num("beta_fast") if params.get("beta_fast") else 32.0,
                    beta_slow=num("beta_slow") if params.get("beta_slow") else 1.0,
                    truncate=truncate, attention_factor=attention)


def spec_replace(spec: ModelSpec, **changes) -> ModelSpec:
    return dataclasses.replace(spec, **changes)


def with_weight_types(spec: ModelSpec, types: dict[str, str]) -> ModelSpec:
    """`spec` with the quantized types of a checkpoint's tensors ({HF name: a weight_types name}, as
    gguf_spec.gguf_tensor_types gives): float types become "" (read as `spec.dtype`)."""
    def q(name: str) -> str:
        t = types.get(name, "")
        return t if t in QUANT_BLOCKS else ""
    layers = tuple(tuple(q(f"model.layers.{i}.{n}") for n in LINEAR_NAMES) for i in range(spec.num_layers))
    if not any(t for sig in layers for t in sig):
        layers = ()
    experts = ()
    if spec.moe is not None:                 # expert 0's types are its block's (one stacked tensor per kind)
        experts = tuple(tuple(q(f"model.layers.{i}.{n}") for n in spec.moe.expert_weight_names(0))
                        if spec.is_moe_layer(i) else ("", "", "") for i in range(spec.num_layers))
        if not any(t for sig in experts for t in sig):
            experts = ()
    lm = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    return dataclasses.replace(spec, layer_types=layers, head_type=q(lm), embed_type=q("model.embed_tokens.weight"),
                               expert_types=experts)


def _set_fields(obj) -> dict:
    """A dataclass as a dict of the fields that differ from their defaults (nested dataclasses alike): a field added
    later with a default that keeps the old behaviour leaves every existing architecture's hash, and its bundles, as
    they were."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING and v == f.default:
            continue
        out[f.name] = _set_fields(v) if dataclasses.is_dataclass(v) else to_dict(v)
    return out
