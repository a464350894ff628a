"""Program analysis (thesis 4.1.1): partition units and what each one costs, from the model
configuration alone (eqs. 4.1-4.5, 4.9, 4.11, 4.12).

Partition units, in order: unit 0 = embedding, units 1..L = transformer blocks 0..L-1, unit L+1 =
final norm + lm_head. Per unit: W_param (weight bytes streamed per decode step, independent of the
batch), the bytes its device must hold, projection FLOPs per token, and per-token KV and attention
coefficients (W_kv and F_attn are these times B and the context c). Quantities add up, so a stage
(a contiguous run of units) is a `StageLoad`, and any stage is a difference of two prefix sums:
the partition search stays O(L).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.model.spec import DTYPE_BYTES, LINEAR_NAMES, ModelSpec

UNIT_KINDS = ("embedding", "block", "head")
PRE_ATTN_LINEARS = LINEAR_NAMES[:3]     # q, k, v: the pre_attn function's; the rest are post_attn's
FP16_BYTES = 2                          # a dequantized weight (the GPU prefill's GEMMs read fp16)
# The runtime attends over KV in tiles of this many keys during prefill (the KV page size of thesis
# 4.2.2), so prefill attention scores take B*h_a*S*min(S, tile)*4 bytes, not B*h_a*S*S*4.
ATTENTION_TILE_TOKENS = 512
FP32_BYTES = 4


@dataclass(frozen=True)
class PartitionUnit:
    index: int
    kind: str                          # "embedding" | "block" | "head"
    param_bytes: int                   # W_param (eq. 4.3): weight bytes read per step, whatever B is
    gather_bytes_per_token: int        # embedding rows gathered per token (the embedding's W_param at B=1)
    stored_bytes: int                  # bytes the device holding this unit must keep
    proj_flops_per_token: int          # eq. 4.9 / B for one block; 2*H*V for the head
    kv_bytes_per_token: int            # eq. 4.12 / (B c): 2 h_kv d_h d_sz for a block, else 0
    attn_flops_per_context_token: int  # eq. 4.11 / (B c): 4 h_a d_h for a block, else 0
    act_bytes_per_token: int           # eq. 4.4 / B: the hidden state leaving this unit (0 for the head)
    # The share of kv_bytes_per_token a sliding-window block holds only for its window (its pages leave the CPU
    # cache as the window passes them): kv_bytes_per_token for such a block, else 0.
    sliding_kv_bytes_per_token: int = 0

    def __post_init__(self):
        if self.kind not in UNIT_KINDS:
            raise HelmcError(f"partition unit: kind expected one of {UNIT_KINDS}, found {self.kind!r}")
        if min(self.param_bytes, self.gather_bytes_per_token, self.stored_bytes, self.proj_flops_per_token,
               self.kv_bytes_per_token, self.attn_flops_per_context_token, self.act_bytes_per_token,
               self.sliding_kv_bytes_per_token) < 0 or self.sliding_kv_bytes_per_token > self.kv_bytes_per_token:
            raise HelmcError(f"partition unit {self.index}: costs expected >= 0, the sliding KV share at most the KV")

    def w_kv(self, context: int, batch: int = 1) -> int:
        """Eq. 4.5 / 4.12 for this unit: KV bytes read per decode step at context c."""
        return batch * context * self.kv_bytes_per_token

    def w_act(self, batch: int = 1, tokens: int = 1) -> int:
        """Eq. 4.4: bytes crossing PCIe if this unit were the last on the CPU."""
        return batch * tokens * self.act_bytes_per_token


@dataclass(frozen=True)
class StageLoad:
    """The summed costs of a contiguous run of units (a stage). Counts are ints so that stages
    subtract exactly; `embeddings` and `heads` are 0 or 1."""
    units: int = 0
    blocks: int = 0
    embeddings: int = 0
    heads: int = 0
    param_bytes: int = 0
    gather_bytes_per_token: int = 0
    stored_bytes: int = 0
    block_flops_per_token: int = 0
    head_flops_per_token: int = 0
    kv_bytes_per_token: int = 0
    attn_flops_per_context_token: int = 0
    block_param_bytes: int = 0          # param_bytes of the block units alone (what a per-block overhead scales by)
    sliding_kv_bytes_per_token: int = 0  # the part of kv_bytes_per_token held only for a sliding window

    def __add__(self, other: "StageLoad") -> "StageLoad":
        return StageLoad(*(a + b for a, b in zip(_load_values(self), _load_values(other))))

    def __sub__(self, other: "StageLoad") -> "StageLoad":
        values = tuple(a - b for a, b in zip(_load_values(self), _load_values(other)))
        if min(values) < 0:
            raise HelmcError("stage load: subtracting a larger stage (prefix sums out of order)")
        return StageLoad(*values)

    @classmethod
    def of(cls, unit: PartitionUnit) -> "StageLoad":
        block, head = unit.kind == "block", unit.kind == "head"
        return cls(units=1, blocks=int(block), embeddings=int(unit.kind == "embedding"), heads=int(head),
                   param_bytes=unit.param_bytes, gather_bytes_per_token=unit.gather_bytes_per_token,
                   stored_bytes=unit.stored_bytes,
                   block_flops_per_token=unit.proj_flops_per_token if not head else 0,
                   head_flops_per_token=unit.proj_flops_per_token if head else 0,
                   kv_bytes_per_token=unit.kv_bytes_per_token,
                   attn_flops_per_context_token=unit.attn_flops_per_context_token,
                   block_param_bytes=unit.param_bytes if block else 0,
                   sliding_kv_bytes_per_token=unit.sliding_kv_bytes_per_token)


# The fields in order, read without dataclasses.astuple's deep copy: the hybrid search adds and subtracts
# thousands of loads per plan.
_load_values = operator.attrgetter(*(f.name for f in dataclasses.fields(StageLoad)))


@dataclass(frozen=True)
class ProgramAnalysis:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    dtype_bytes: int
    tied_embeddings: bool
    tied_matrix_bytes: int            # the V x H matrix embedding and lm_head share when tied, as stored
    sliding_window: int               # 0: every block attends over the whole context
    max_position_embeddings: int
    units: tuple[PartitionUnit, ...]
    prefix: tuple[StageLoad, ...]     # prefix[i] = sum of units[:i]; len = num_units + 1
    # Bytes of every block's linear weights per stored type (a float dtype or a weight_types block format), summed over the blocks:
    # the CPU's GEMV read rate differs by type (quantized kernels decode more per byte), so M is their mix.
    linear_bytes_by_type: tuple[tuple[str, int], ...] = ()
    # The lm_head's matrix as stored, (type, bytes): a quantized model's head is often fp16 (the GPU's GEMV rate
    # differs by type as the CPU's does; the GPU's M mixes the head in, where it is the largest single matrix).
    head_bytes_by_type: tuple[tuple[str, int], ...] = ()
    # VRAM the GPU prefill of a block with quantized weights holds: each prefill function dequantizes its weights to
    # fp16 one at a time into one reused buffer, the largest (lower_quantized_gpu): pre_attn's plus post_attn's.
    quantized_prefill_scratch_bytes: int = 0
    # The same for a quantized lm_head on the GPU, whose prefill function serving steps of several rows call.
    quantized_head_scratch_bytes: int = 0
    # Columns of a RoPE table row (ModelSpec.rope_width; 0: head_dim): the streamed prefill holds the prompt's rows.
    rope_width: int = 0

    def __post_init__(self):
        if len(self.units) != self.num_layers + 2 or len(self.prefix) != len(self.units) + 1:
            raise HelmcError(f"program analysis: expected {self.num_layers + 2} units and one more prefix sum, "
                             f"found {len(self.units)} and {len(self.prefix)}")

    @property
    def num_units(self) -> int:
        return self.num_layers + 2

    @property
    def tied_bytes(self) -> int:
        """The V x H matrix shared by embedding and lm_head when tied: held once per device."""
        return self.tied_matrix_bytes if self.tied_embeddings else 0

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def act_bytes_per_token(self) -> int:
        return self.hidden_size * self.dtype_bytes

    def stage(self, lo: int, hi: int) -> StageLoad:
        """Units [lo, hi) in O(1)."""
        if not 0 <= lo <= hi <= self.num_units:
            raise HelmcError(f"stage: expected 0 <= lo <= hi <= {self.num_units}, found [{lo}, {hi})")
        return self.prefix[hi] - self.prefix[lo]

    def held_bytes(self, load: StageLoad) -> int:
        """Weight bytes a device holding this stage keeps (a tied matrix counted once)."""
        return load.stored_bytes - (self.tied_bytes if load.embeddings and load.heads else 0)

    def workspace_bytes(self, load: StageLoad, batch: int, seq_len: int) -> int:
        """Peak live activations of one stage while it runs `seq_len` tokens per sequence (prefill
        of the prompt is the peak; decode is seq_len = 1). Buffers are reused across units, so this
        is a maximum over unit kinds, not a sum."""
        n = batch * seq_len
        H, d = self.hidden_size, self.dtype_bytes
        peak = n * H * d if load.units else 0                          # [B*S, H] hidden state in/out
        if load.blocks:
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            hidden = 4 * n * H * d                                     # residual, normed, attn out, mlp out
            qkv = n * (q + 2 * kv) * d                                 # [B*S, Q + 2 KV]
            mlp = 3 * n * self.intermediate_size * d                   # gate, up, silu(gate)*up: [B*S, I] each
            scores = batch * self.num_heads * seq_len * min(seq_len, ATTENTION_TILE_TOKENS) * FP32_BYTES
            peak = max(peak, hidden + qkv + mlp + scores)
        if load.heads:
            # Logits only for the last position of each sequence, in fp32: [B, V].
            peak = max(peak, n * H * d + batch * self.vocab_size * FP32_BYTES)
        return peak


def _shape_elems(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def analyze_program(spec: ModelSpec, dtype: str | None = None) -> ProgramAnalysis:
    """Per-unit W_param, W_act and W_kv (and FLOPs) of `spec`, for the checkpoint dtype or `dtype`."""
    dtype = dtype or spec.dtype
    if dtype not in DTYPE_BYTES:
        raise HelmcError(f"analyze_program: dtype expected one of {sorted(DTYPE_BYTES)}, found {dtype!r}")
    d = DTYPE_BYTES[dtype]
    H, V, I = spec.hidden_size, spec.vocab_size, spec.intermediate_size
    Q, KV = spec.q_dim, spec.kv_dim
    block_params = sum(_shape_elems(s) for s in spec.block_weight_shapes().values())   # eqs. 4.1-4.3
    # Eq. 4.9 per token and block, written for q_dim != H: q, k, v, o and the three MLP matrices.
    block_flops = 2 * (H * Q + 2 * H * KV + Q * H + 3 * H * I)
    # Weight bytes as stored: quantized linears at their block size (spec.tensor_bytes), the rest at d.
    embed_bytes = spec.tensor_bytes((V, H), spec.embed_type) if dtype == spec.dtype else V * H * d
    units = [PartitionUnit(index=0, kind="embedding", param_bytes=0, gather_bytes_per_token=embed_bytes // V,
                           stored_bytes=embed_bytes, proj_flops_per_token=0, kv_bytes_per_token=0,
                           attn_flops_per_context_token=0, act_bytes_per_token=H * d)]
    kv_token = 2 * spec.num_kv_heads * spec.head_dim * d                                               # eq. 4.5
    for i in range(spec.num_layers):
        block_bytes = spec.block_weight_bytes(i) if dtype == spec.dtype else block_params * d
        units.append(PartitionUnit(index=i + 1, kind="block", param_bytes=block_bytes,
                                   gather_bytes_per_token=0, stored_bytes=block_bytes,
                                   proj_flops_per_token=block_flops, kv_bytes_per_token=kv_token,
                                   attn_flops_per_context_token=4 * spec.num_heads * spec.head_dim,  # eq. 4.11
                                   act_bytes_per_token=H * d,                                        # eq. 4.4
                                   sliding_kv_bytes_per_token=kv_token if spec.layer_window(i) else 0))
    # lm_head (the tied matrix streams all the same) + final norm
    lm_type = spec.embed_type if spec.tie_word_embeddings else spec.head_type
    head_bytes = (spec.tensor_bytes((V, H), lm_type) if dtype == spec.dtype else V * H * d) + H * d
    units.append(PartitionUnit(index=spec.num_layers + 1, kind="head", param_bytes=head_bytes,
                               gather_bytes_per_token=0, stored_bytes=head_bytes, proj_flops_per_token=2 * H * V,
                               kv_bytes_per_token=0, attn_flops_per_context_token=0, act_bytes_per_token=0))
    by_type: dict[str, int] = {}
    scratch: dict[bool, int] = {}                   # pre_attn's linear? -> its largest quantized weight in fp16
    for i in range(spec.num_layers):
        for name in LINEAR_NAMES:
            qtype = spec.weight_type(i, name) if dtype == spec.dtype else ""
            shape = spec.block_weight_shapes()[name]
            by_type[qtype or dtype] = by_type.get(qtype or dtype, 0) + (
                spec.tensor_bytes(shape, qtype) if qtype else _shape_elems(shape) * d)
            if qtype:
                pre = name in PRE_ATTN_LINEARS
                scratch[pre] = max(scratch.get(pre, 0), _shape_elems(shape) * FP16_BYTES)
    head_quantized = dtype == spec.dtype and bool(lm_type)
    prefix = [StageLoad()]
    for u in units:
        prefix.append(prefix[-1] + StageLoad.of(u))
    return ProgramAnalysis(
        architecture=spec.architecture, num_layers=spec.num_layers, hidden_size=H, intermediate_size=I,
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=V,
        dtype=dtype, dtype_bytes=d, tied_embeddings=spec.tie_word_embeddings, tied_matrix_bytes=embed_bytes,
        sliding_window=spec.sliding_window,
        max_position_embeddings=spec.max_position_embeddings, units=tuple(units), prefix=tuple(prefix),
        linear_bytes_by_type=tuple(sorted(by_type.items())),
        head_bytes_by_type=(((lm_type if dtype == spec.dtype else "") or dtype, head_bytes - H * d),),
        quantized_prefill_scratch_bytes=sum(scratch.values()),
        quantized_head_scratch_bytes=V * H * FP16_BYTES if head_quantized else 0, rope_width=spec.rope_width)
