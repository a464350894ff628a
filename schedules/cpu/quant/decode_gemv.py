"""The CPU stage's decode GEMV over a quantized weight: integer dot products where the ISA has them, else fp32 lanes.

make_gemv_quant(qtype, n, k, isa, tuning, m): PrimFunc(x: float32[m, k], w: uint8[n, row_bytes], y: float32[m, n]).
Q3_K / Q4_K / Q5_K / Q6_K / Q4_0 / MXFP4 on AVX-512 quantize x to int8 once per call (gemv_int8.py, quant/q4_0_int8.py,
quant/mxfp4_int8.py: llama.cpp's arithmetic, ~5e-3 of max |y|
from the int8 rounding of x); everything else widens each weight to fp32 (gemv_quant.py, exact to fp32 rounding).
"""
from __future__ import annotations

from tvm import tirx

from helmc.schedules.cpu.gemv_quant import DEFAULT_TUNING, QuantGemvTuning, float_tiles, make_gemv_quant_float
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.gemv_int8 import int8_gemv_applies, int8_tiles, make_gemv_quant_int8
from helmc.schedules.cpu.quant.tiles import QuantTiles


def make_gemv_quant(qtype: str, n: int, k: int, isa: VectorIsa,
                    tuning: QuantGemvTuning = DEFAULT_TUNING, m: int = 1) -> tirx.PrimFunc:
    """Row t of y is bit-identical to what the m = 1 kernel computes from x[t] alone (either kernel)."""
    if int8_gemv_applies(qtype, isa, k):
        return make_gemv_quant_int8(qtype, n, k, isa, tuning, m)
    return make_gemv_quant_float(qtype, n, k, isa, tuning, m)


def quant_tiles(qtype: str, m: int, k: int, isa: VectorIsa, tuning: QuantGemvTuning = DEFAULT_TUNING) -> QuantTiles:
    """How make_gemv_quant's kernel for m > 1 rows blocks its rows and tiles K (quant/tiles.py)."""
    return (int8_tiles if int8_gemv_applies(qtype, isa, k) else float_tiles)(qtype, m, k, isa, tuning)
