"""The profile kit: the code `helmc profile` measures with, compiled for one target.

`helmc profile` measures the machine with what helmc will run there (numpy's reads said 36.8 GB/s
on a Xeon where helmc's CPU stage reads ~92): helmc's stream-read kernel and its decode GEMVs, and helmc's
compiled CPU and GPU stages on a synthetic model, whose per-block overhead is fitted as `helmc calibrate` fits a
real bundle's. A kit directory holds them:

    profile_kit.json       ProfileKit: target, block shape, kernel names, buffer sizes
    profile_kernels.so     the stream reads, every decode GEMV (per weight type) and a prefill GEMM, for the target's
                           CPU features
    gpu_gemv/              helmc's GPU decode GEMVs of one block per weight type, as the GPU stage launches them
                           (only when built for a GPU arch)
    cpu_bundle/            a bundle of the synthetic model with every unit on the CPU (plan all-CPU)
    gpu_bundle/            the same model with every unit on the GPU (only when built for a GPU arch)

helmc.compiler.profile_kit builds one (cached in the artifact cache, so a second profile compiles nothing); a
machine with only the TVM runtime measures with a kit built elsewhere (`helmc profile --kit DIR`). The synthetic
model's weights are random and written at measure time (write_synthetic_weights), never shipped.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError
from helmc.jsonio import atomic_write_text, from_dict, load_json_file, to_dict
from helmc.model.arch import ARCHITECTURES
from helmc.model.weight_types import GPU_INT8_TYPES, KIT_BLOCK_TYPES, KIT_FLOAT_DTYPES

KIT_FORMAT_VERSION = 4          # 2: GEMVs at every ROWS_MEASURED; 3: quantized GEMVs fused where the stage fuses
# them; 4: the GPU q5_k / q3_k GEMVs fused too (their int8 GEMV)
KIT_FILE = "profile_kit.json"
KERNELS_LIB = "profile_kernels.so"
# The weight types the kit measures (weight_types' `kit` entries): float ones by their dtype, block formats by name.
FLOAT_TYPES = KIT_FLOAT_DTYPES
QUANT_TYPES = KIT_BLOCK_TYPES
# One decode step's GEMV launches over a block, as helmc's CPU stage makes them (lower_linear): float weights
# fused (q/k/v in one launch, gate/up with the SwiGLU); quantized ones one launch per linear, except where the
# stage fuses those that share x (gemv_int8_multi.quant_gemvs_fuse: one token on the int8 path), q/k/v in one
# launch and gate/up in another (the SwiGLU a separate elementwise op).
FLOAT_ROLES = ("qkv", "o", "swiglu", "down")
QUANT_ROLES = ("q", "k", "v", "o", "gate", "up", "down")
QUANT_FUSED_ROLES = ("qkv", "o", "gate_up", "down")
# The linears a multi-output quantized launch covers, its outputs in this order; any other role covers itself.
FUSED_LINEARS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
SYNTHETIC_VOCAB = 4096
SYNTHETIC_ARCH = "Qwen3ForCausalLM"     # the synthetic model's architecture (helmc.model.arch)
# The GPU stage's decode GEMV launches per block: fp16 / bf16 and the int8-activation types fused as the CPU's
# float ones (q/k/v one launch, gate/up with SwiGLU, down with the residual add), the other block types one per linear.
GPU_FUSED_TYPES = FLOAT_TYPES + tuple(t for t in GPU_INT8_TYPES if t in QUANT_TYPES)
GPU_GEMV_DIR, GPU_GEMV_NAME = "gpu_gemv", "gpu_gemv"
# Decode rows the GEMVs are measured at: one token, and a batched step of 8 sequences (`helmc serve --max-batch 8`),
# where a CPU's GEMV may turn compute-bound; the cost model scales between them (CpuProfile.read_gbs).
ROWS_MEASURED = (1, 8)


@dataclass(frozen=True)
class BlockShape:
    """The transformer block the kernels and the synthetic model have (default: Qwen3-8B's)."""
    hidden: int = 4096
    ffn: int = 12288
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear, HF layout, by QUANT_ROLES name."""
        H, I, Q, KV = self.hidden, self.ffn, self.q_dim, self.kv_dim
        return {"q": (Q, H), "k": (KV, H), "v": (KV, H), "o": (H, Q), "gate": (I, H), "up": (I, H), "down": (H, I)}

    def hf_config(self, layers: int, vocab: int = SYNTHETIC_VOCAB) -> dict:
        """config.json of the synthetic model: a Qwen3 of this block, fp16, a small vocabulary."""
        arch = ARCHITECTURES[SYNTHETIC_ARCH]
        return {"architectures": [arch.hf_class], "model_type": arch.model_type, "hidden_size": self.hidden,
                "intermediate_size": self.ffn, "num_hidden_layers": layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": vocab,
                "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 0, "eos_token_id": 0}


QUICK_BLOCK = BlockShape(hidden=1024, ffn=3072, heads=8, kv_heads=2, head_dim=128)


@dataclass(frozen=True)
class KitKernel:
    weight_type: str                 # FLOAT_TYPES or QUANT_TYPES
    role: str                        # FLOAT_ROLES, QUANT_ROLES or QUANT_FUSED_ROLES
    name: str                        # the function's symbol in profile_kernels.so
    rows: int = 1                    # decode rows per call (ROWS_MEASURED): a batched step of that many sequences


def _roles(weight_type: str, fused_types: tuple[str, ...]) -> tuple[str, ...]:
    """A block's GEMV launches for weights of `weight_type`: the fused ones (FLOAT_ROLES) for `fused_types`, one per
    linear (QUANT_ROLES) for the other quantized types; none for an unknown type."""
    return FLOAT_ROLES if weight_type in fused_types else QUANT_ROLES if weight_type in QUANT_TYPES else ()


@dataclass(frozen=True)
class ProfileKit:
    format_version: int
    isa: str                         # schedules.cpu.isa tier the kernels were compiled for
    required_flags: tuple[str, ...]  # /proc/cpuinfo flags the compiled code executes
    l3_bytes: int                    # the target's L3, which sized the reads below
    cores: int
    block: BlockShape
    read_elements: int               # fp32 elements of the DRAM read (>= 4 x L3)
    l3_read_elements: int            # fp32 elements of the cache read (half the L3)
    read_name: str
    l3_read_name: str
    kernels: tuple[KitKernel, ...]
    gemm_name: str                   # helmc's prefill GEMM, fp16 weights [ffn, hidden], symbolic tokens: P on the CPU
    attention_name: str = ""         # helmc's decode attention over the block's fp16 KV ("": a kit from before it)
    cpu_bundle: str = ""             # directory in the kit ("" : none)
    gpu_bundle: str = ""
    gpu_arch: str = ""               # what gpu_bundle was compiled for
    synthetic_layers: int = 0        # blocks per timed step of the synthetic bundles
    quick: bool = False              # small shapes: figures not fit for planning
    gpu_gemv_kernels: tuple[KitKernel, ...] = ()   # in GPU_GEMV_DIR (built with gpu_arch; () in older kits)

    def __post_init__(self):
        if self.format_version != KIT_FORMAT_VERSION:
            raise HelmcError(f"profile kit: format_version expected {KIT_FORMAT_VERSION}, found {self.format_version}")
        if self.read_elements <= 0 or self.l3_read_elements <= 0:
            raise HelmcError(f"profile kit: read sizes expected > 0, found {self.read_elements}, {self.l3_read_elements}")
        for k in self.kernels:
            roles = _roles(k.weight_type, FLOAT_TYPES)
            roles += QUANT_FUSED_ROLES if roles == QUANT_ROLES else ()
            if k.role not in roles:
                raise HelmcError(f"profile kit: kernel {k.name} expected a role of {k.weight_type!r} weights among "
                                 f"{roles}, found {k.role!r}")
            if k.rows < 1:
                raise HelmcError(f"profile kit: kernel {k.name} expected rows >= 1, found {k.rows}")
        for t in self.weight_types:
            for m in self.rows_measured(t):
                launches = self.gemv_roles(t, m)
                if launches not in (FLOAT_ROLES, QUANT_ROLES, QUANT_FUSED_ROLES):
                    raise HelmcError(f"profile kit: {t} GEMVs at {m} rows expected one block's launches in order, "
                                     f"found roles {launches}")
        if bool(self.gpu_bundle) != bool(self.gpu_arch):
            raise HelmcError("profile kit: gpu_bundle and gpu_arch expected both set or both empty")
        for k in self.gpu_gemv_kernels:
            roles = _roles(k.weight_type, GPU_FUSED_TYPES)
            if k.role not in roles or k.rows != 1:
                raise HelmcError(f"profile kit: GPU kernel {k.name} expected one row and a role of {k.weight_type!r} "
                                 f"weights among {roles}, found {k.role!r} at {k.rows} rows")
        if self.gpu_gemv_kernels and not self.gpu_arch:
            raise HelmcError("profile kit: GPU GEMV kernels expected with a gpu_arch, found none")

    @property
    def weight_types(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k.weight_type for k in self.kernels))

    def rows_measured(self, weight_type: str) -> tuple[int, ...]:
        return tuple(sorted({k.rows for k in self.kernels if k.weight_type == weight_type}))

    def gemv_roles(self, weight_type: str, rows: int = 1) -> tuple[str, ...]:
        """The roles of one block's GEMV launches for `weight_type` at `rows`, in launch order."""
        return tuple(k.role for k in self.kernels if k.weight_type == weight_type and k.rows == rows)

    def kernel(self, weight_type: str, role: str, rows: int = 1) -> str:
        for k in self.kernels:
            if k.weight_type == weight_type and k.role == role and k.rows == rows:
                return k.name
        raise HelmcError(f"profile kit: no {role} kernel for {weight_type} weights at {rows} rows")

    def gpu_gemv_roles(self, weight_type: str) -> dict[str, str]:
        """{role: kernel name} of one weight type's GPU decode GEMVs (in launch order)."""
        return {k.role: k.name for k in self.gpu_gemv_kernels if k.weight_type == weight_type}

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def load(cls, kit_dir: str) -> "ProfileKit":
        path = os.path.join(kit_dir, KIT_FILE)
        if not os.path.isfile(path):
            raise HelmcError(f"profile kit: expected {KIT_FILE} in {kit_dir}, found none (build one with "
                             f"`helmc profile --build-kit DIR`)")
        return from_dict(cls, load_json_file(path, "profile kit"), f"profile kit {path}")

    def save(self, kit_dir: str) -> None:
        atomic_write_text(os.path.join(kit_dir, KIT_FILE), self.to_json() + "\n")


def check_kit_runs_here(kit: ProfileKit, cpu_flags: tuple[str, ...]) -> None:
    """The kit's code executes only instructions this CPU has (else the kernels would fault mid-measurement)."""
    have = {f.lower() for f in cpu_flags}
    lacking = [f for f in kit.required_flags if f.lower() not in have]
    if lacking:
        raise HelmcError(f"profile kit: compiled for CPU flags {lacking} that this CPU lacks; expected a kit built "
                         f"for this CPU (helmc profile builds one here)")


# ---- the synthetic model's weights ----------------------------------------------------------------------
def synthetic_tensors(block: BlockShape, layers: int, vocab: int = SYNTHETIC_VOCAB) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the synthetic Qwen3 reads, in file order, blocks 0..layers-1."""
    H, D = block.hidden, block.head_dim
    out = [("model.embed_tokens.weight", (vocab, H))]
    lin = block.linear_shapes()
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", lin["q"]),
                (p + "self_attn.k_proj.weight", lin["k"]), (p + "self_attn.v_proj.weight", lin["v"]),
                (p + "self_attn.q_norm.weight", (D,)), (p + "self_attn.k_norm.weight", (D,)),
                (p + "self_attn.o_proj.weight", lin["o"]), (p + "post_attention_layernorm.weight", (H,)),
                (p + "mlp.gate_proj.weight", lin["gate"]), (p + "mlp.up_proj.weight", lin["up"]),
                (p + "mlp.down_proj.weight", lin["down"])]
    return out + [("model.norm.weight", (H,)), ("lm_head.weight", (vocab, H))]


def write_synthetic_weights(out_dir: str, block: BlockShape, layers: int, vocab: int = SYNTHETIC_VOCAB,
                            seed: int = 0) -> str:
    """model.safetensors with random fp16 weights (N(0, 0.02); norms 1 + N(0, 0.02)) for blocks 0..layers-1:
    the blocks a timed step binds. Values are drawn once as a pool and tiled: timing needs finite, normal
    numbers, not independent ones, and drawing a Qwen3-8B block's 200M values would take seconds each."""
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = (0.02 * rng.standard_normal(1 << 20)).astype(np.float16)
    entries, offset = [], 0
    tensors = synthetic_tensors(block, layers, vocab)
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        entries.append((name, shape, offset))
        offset += n
    header = {name: {"dtype": "F16", "shape": list(shape), "data_offsets": [start, start + int(np.prod(shape)) * 2]}
              for name, shape, start in entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = os.path.join(out_dir, "model.safetensors")
    with open(path + ".partial", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, (name, shape, _) in enumerate(entries):
            count = int(np.prod(shape))
            values = np.resize(np.roll(pool, i * 7919), count)        # [count] fp16, a different phase per tensor
            if name.endswith("norm.weight"):
                values = (values + np.float16(1.0)).astype(np.float16)
            values.tofile(f)
    os.replace(path + ".partial", path)
    return out_dir
