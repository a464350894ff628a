"""IQ4_XS's block quantizer: ggml's quantize_row_iq4_xs_ref (quantize_row_iq4_nl_impl with 32-weight sub-blocks,
ntry 7, no importance matrix), vectorised over sub-blocks as quant_formats' K-quants are: arrays [32 elements,
sub-blocks], every sum over a sub-block's elements a sequential float32 reduction over the outer axis, the order of
ggml's C loop.

Per sub-block of 32: weights x^2; d from the value of largest |x| placed at -127, refined by least squares over the
table indices (best_index_int8: nearest table value, ties to the upper one) and 15 more trial scales (itry -7..7);
the block's d = -(the sub-block scale of largest |.|) / 32 in fp16, each sub-block's 6-bit l = nearest(scale / d)
in [-32, 31] (stored + 32), and the indices found again under d * l.
"""
from __future__ import annotations

import numpy as np

IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32)
_EPS = np.float32(1e-15)      # ggml's GROUP_MAX_EPS
_NTRY = 7


def _best_index(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over IQ4_VALUES per element of float32 v: the nearest value, the upper on a tie."""
    mu = np.clip(np.searchsorted(IQ4_VALUES, v, side="right"), 1, 15)     # val[mu - 1] <= v < val[mu] inside
    lower = (v - IQ4_VALUES[mu - 1]) < (IQ4_VALUES[mu] - v)
    idx = np.where(lower, mu - 1, mu)
    return np.where(v <= IQ4_VALUES[0], 0, np.where(v >= IQ4_VALUES[15], 15, idx)).astype(np.uint8)


def _sums(x: np.ndarray, w: np.ndarray, idx: np.ndarray):
    """sum_j w*q*x and sum_j w*q*q in ggml's order ([32, sub-blocks] arrays, reduced over axis 0 in sequence)."""
    q = IQ4_VALUES[idx]
    sumqx, sumq2 = np.zeros(x.shape[1], np.float32), np.zeros(x.shape[1], np.float32)
    for j in range(x.shape[0]):
        sumqx = sumqx + w[j] * q[j] * x[j]
        sumq2 = sumq2 + w[j] * q[j] * q[j]
    return sumqx, sumq2


def iq4_xs_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [blocks, 136] of float32 [blocks, 256] in block_iq4_xs's layout."""
    nb = blocks.shape[0]
    x = np.ascontiguousarray(blocks.astype(np.float32).reshape(nb * 8, 32).T)      # [32, sub-blocks]
    w = x * x
    pick = np.abs(x).argmax(axis=0)                                                  # the first largest |x|
    mx = x[pick, np.arange(x.shape[1])]
    amax = np.abs(mx)
    live = amax >= _EPS
    safe = np.where(live, mx, np.float32(1))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = -safe / IQ4_VALUES[0]
        sumqx, sumq2 = _sums(x, w, _best_index((np.float32(1) / d) * x))
        d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0)).astype(np.float32)
        best = d * sumqx
        for itry in range(-_NTRY, _NTRY + 1):
            sumqx, sumq2 = _sums(x, w, _best_index((np.float32(itry + IQ4_VALUES[0]) / safe) * x))
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d).astype(np.float32)
            best = np.where(better, d * sumqx, best).astype(np.float32)
    scales = np.where(live, d, np.float32(0)).reshape(nb, 8)                        # [blocks, 8]
    first = np.abs(scales).argmax(axis=1)                                            # the first largest |scale|
    max_scale = scales[np.arange(nb), first]
    dblock = (-max_scale / np.float32(32)).astype(np.float32)                        # -0.0 where all are 0
    with np.errstate(divide="ignore"):
        inv = np.where(dblock != 0, np.float32(1) / dblock, np.float32(0)).astype(np.float32)
    level = np.clip(np.rint(inv[:, None] * scales), -32, 31).astype(np.int32)        # [blocks, 8]
    dl = (dblock[:, None] * level.astype(np.float32)).reshape(-1)                     # [sub-blocks]
    with np.errstate(divide="ignore"):
        idl = np.where(dl != 0, np.float32(1) / dl, np.float32(0)).astype(np.float32)
    idx = _best_index(idl * x).T.reshape(nb, 8, 32)                                  # [blocks, 8, 32]
    ls = (level + 32).astype(np.uint16)
    out = np.empty((nb, 136), np.uint8)
    out[:, 0:2] = dblock.astype(np.float16)[:, None].view(np.uint8)
    out[:, 2:4] = (((ls >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(1, dtype=np.uint16)[:, None].view(np.uint8)
    out[:, 4:8] = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    out[:, 8:] = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(nb, 128)
    return out
