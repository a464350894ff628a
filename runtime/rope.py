"""RoPE cos/sin tables, computed on the host and fed to pre_attn as inputs.

Computing them here keeps the compiled block independent of the RoPE variant (default, linear,
llama3) and of absolute positions. float32 throughout, in the same order of operations as
Hugging Face transformers, so positions far into the context round the same way.
"""
from __future__ import annotations

import math

import numpy as np

from helmc.model.spec import RopeSpec


def inv_freq(rope: RopeSpec, head_dim: int) -> np.ndarray:
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    f = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)  # [D/2]
    if rope.kind == "linear":
        return (f / np.float32(rope.factor)).astype(np.float32)
    if rope.kind == "llama3":
        old = rope.original_max_position
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / f
        scaled = np.where(wavelen > low_wavelen, f / rope.factor, f)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    return f


def _yarn_inv_freq(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """YaRN's frequencies in transformers' float32 steps: each of the D/2 a blend of the original (extrapolated)
    and the factor-interpolated one, by a linear ramp over the dimensions between the ones that turn beta_fast and
    beta_slow times over the original context."""
    # theta ** (i / D) rounded once from float64: within an ulp of torch's float32 pow, which NumPy's float32 pow is
    # not at every i
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = (np.float64(np.float32(rope.theta)) ** exponent.astype(np.float64)).astype(np.float32)
    extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)


class RopeTables:
    # A decode step's one position comes from a table of CHUNK positions made when the step first enters it: the
    # per-step NumPy calls cost ~47 us of the host's path between two all-GPU decode steps (H200 host,
    # cProfile), against ~1 us for the rows' copy. The table's rows are the one-position computation's bits: NumPy's
    # cos / sin are elementwise, and each row's D values take the same vector path whatever the rows around them
    # (tests/model/test_rope_tables.py checks it).
    CHUNK = 256

    def __init__(self, rope: RopeSpec, head_dim: int, local: RopeSpec | None = None):
        # local: the sliding-window blocks' own RoPE (Gemma 3): each row is then [global D | local D], and the
        # stage hands each block its half (Stage.rope_halves).
        self.inv_freq = inv_freq(rope, head_dim)
        # YaRN scales cos and sin (so q.k) by its attention factor; local RoPEs are unscaled (Gemma 3's default).
        self.scale = np.float32(rope.attention_factor) if rope.kind == "yarn" else None
        self.local_inv_freq = None if local is None else inv_freq(local, head_dim)
        self._chunk: tuple[int, np.ndarray, np.ndarray] | None = None     # (first position, cos, sin)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [S, D] float32 of the positions ([S, 2D] with a local RoPE: the global table's D, then the
        local's); new arrays: the caller may keep or change them."""
        if len(positions) != 1:
            return self._compute(positions)
        p = int(positions[0])
        first = p - p % self.CHUNK
        if self._chunk is None or self._chunk[0] != first:
            self._chunk = (first, *self._compute(np.arange(first, first + self.CHUNK)))
        i = p - first
        return self._chunk[1][i:i + 1].copy(), self._chunk[2][i:i + 1].copy()

    def _compute(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tables = [_cos_sin(positions, self.inv_freq, self.scale)]
        if self.local_inv_freq is not None:
            tables.append(_cos_sin(positions, self.local_inv_freq))
            return tuple(np.concatenate(t, axis=-1) for t in zip(*tables))       # [S, D] x 2 -> [S, 2D]
        return tables[0]


def rope_tables(spec) -> RopeTables:
    """The RoPE tables of a ModelSpec (with the sliding-window blocks' own where it has one)."""
    return RopeTables(spec.rope, spec.head_dim, spec.local_rope)


def rope_half(rows, local: bool, head_dim: int):
    """The columns of RoPE rows [S, rope_width] (NumPy or CuPy; RopeTables.cos_sin) a block takes, a view: the local
    table's head_dim for a block with the local RoPE, else the first head_dim (the global table's, or the only one)."""
    return rows[:, head_dim:2 * head_dim] if local else rows[:, :head_dim]


def block_rope(spec, layer: int, cos, sin) -> tuple:
    """Block `layer`'s (cos, sin) [S, head_dim] of RoPE rows [S, rope_width], views: the choice the stage makes per
    block (Stage.rope_halves by ModelSpec.layer_rope_local), for the paths that run one block at a time."""
    local = spec.layer_rope_local(layer)
    return rope_half(cos, local, spec.head_dim), rope_half(sin, local, spec.head_dim)


def _cos_sin(positions: np.ndarray, f: np.ndarray, scale=None) -> tuple[np.ndarray, np.ndarray]:
    freqs = positions.astype(np.float32)[:, None] * f[None, :]                   # [S] x [D/2] -> [S, D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)                                 # [S, D/2] -> [S, D]
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    if scale is not None:
        cos, sin = (cos * scale).astype(np.float32), (sin * scale).astype(np.float32)
    return cos, sin
