"""Valid GGUF weight rows of the quantized types, random, and gguf's own dequantization of them: the data of the GPU
and CPU quantized-kernel tests, their device builders and the GEMV benchmarks. Imports nothing of the TVM compiler
(the GPU machine's TVM is runtime-only); gguf is imported when a row is made.
"""
from __future__ import annotations

import numpy as np

_GGUF_TYPE = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q5_0": "Q5_0", "q3_k": "Q3_K", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K",
             "iq4_xs": "IQ4_XS", "mxfp4": "MXFP4"}


def random_quant_rows(qtype: str, rows: int, k: int, rng) -> np.ndarray:
    """uint8 [rows, row_bytes]: valid GGUF rows of `qtype` (every fp16 field finite, every scale byte small, weights
    of order 1)."""
    from gguf import GGMLQuantizationType, quants

    from helmc.model.spec import QUANT_BLOCKS      # a plain table: runs where only TVM's runtime is (bench_cpu_gemv)

    block_weights, block_bytes = QUANT_BLOCKS[qtype]
    if qtype in ("q8_0", "q4_0", "q5_0"):
        dense = rng.standard_normal((rows, k)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(dense, GGMLQuantizationType[_GGUF_TYPE[qtype]]))
    blocks = rng.integers(0, 256, (rows, k // block_weights, block_bytes), dtype=np.uint8)  # [rows, blocks, bytes]

    def halves(lo, hi, signed):
        v = rng.uniform(lo, hi, (rows, k // block_weights))
        v = np.where(rng.random(v.shape) < 0.5, -v, v) if signed else v
        return v.astype(np.float16)[..., None].view(np.uint8)                            # [rows, blocks, 2]

    if qtype in ("q4_k", "q5_k"):   # d, dmin at bytes 0..3: w = d*sc*q - dmin*m, |w| <= 4e-3*63*31 < 8
        blocks[:, :, 0:2] = halves(1e-3, 4e-3, False)
        blocks[:, :, 2:4] = halves(1e-3, 4e-3, False)
    elif qtype == "q3_k":        # d at bytes 108..109, either sign: |w| <= 2e-3 * 32 * 4
        blocks[:, :, 108:110] = halves(5e-4, 2e-3, True)
    elif qtype == "iq4_xs":      # d at bytes 0..1, either sign: |w| <= 2e-3 * 32 * 127
        blocks[:, :, 0:2] = halves(5e-4, 2e-3, True)
    elif qtype == "mxfp4":       # e8m0 byte 0: scales 2^-10 .. 2^-1, |w| <= 12 * 2^-1
        blocks[:, :, 0] = rng.integers(118, 128, (rows, k // block_weights))
    else:                        # q6_k: d at bytes 208..209, either sign (ggml's make_qx_quants gives both)
        blocks[:, :, 208:210] = halves(5e-4, 2e-3, True)
    return blocks.reshape(rows, -1)                                                      # [rows, row_bytes]


def dequantize_reference(qtype: str, rows_u8: np.ndarray) -> np.ndarray:
    """float32 [rows, k]: the weights the rows encode, by gguf's numpy dequantizer."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(rows_u8, GGMLQuantizationType[_GGUF_TYPE[qtype]]).astype(np.float32)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| in float64; inf where got has a non-finite value."""
    got = got.astype(np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))

