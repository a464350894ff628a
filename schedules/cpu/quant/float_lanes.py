"""Vector expressions for the fp32-lane decode GEMVs over block formats (gemv_quant.py's per-type block dots):
explicit TIR vectors of the ISA's fp32 width, table lookups of 4-bit fields, lane-index vectors.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.weight_load import widen


class _Vectors:
    """Explicit vector expressions of the isa's fp32 width (TIR Ramp loads, Broadcast scalars)."""

    def __init__(self, isa: VectorIsa):
        self.lanes = isa.fp32_lanes
        self.f16c = not isa.is_slow_fallback
        self.vpermps16 = isa.tier == "avx512"   # a 16-entry table lookup is one vpermps

    def at(self, base, lanes: int | None = None):
        return tirx.Ramp(base, 1, lanes or self.lanes)

    def bcast(self, scalar, lanes: int | None = None):
        return tirx.Broadcast(scalar, lanes or self.lanes)

    def bytes(self, w, row, off, lanes: int | None = None):
        """lanes consecutive bytes of the uint8 view from w[row, off], zero-extended to int32 lanes."""
        return tirx.Cast(f"int32x{lanes or self.lanes}", w[row, self.at(off, lanes)])

    def words(self, w, row, off, lanes: int | None = None):
        """4 * lanes bytes from w[row, off] as int32 lanes: lane i holds bytes 4i..4i+3, byte 4i+j at bit 8j
        (one plain vector load at any alignment; the shifts that pick a byte stay in 32-bit lanes)."""
        lanes = lanes or self.lanes
        return tirx.reinterpret(f"int32x{lanes}", w[row, self.at(off, 4 * lanes)])

    def permute(self, table, index):
        """table[index[i]] per lane; 16 lanes need AVX-512, 8 lanes AVX2."""
        name = {16: "llvm.x86.avx512.permvar.sf.512", 8: "llvm.x86.avx2.permps"}[_lanes(index)]
        return tirx.call_llvm_pure_intrin(f"float32x{_lanes(index)}", name, table, index)

    def shr(self, v, bits):
        return tirx.shift_right(v, tirx.Broadcast(tirx.Cast("int32", bits), _lanes(v)))

    def scale(self, wh, row, half_index):
        """fp16 field at wh[row, half_index] as fp32, broadcast."""
        return self.bcast(widen(wh[row, half_index], "float16", self.f16c))

    def lookup(self, index, table):
        """table(i) for i = the low 4 bits of each int32 lane of `index` (higher bits ignored); `table` maps an
        int32 vector of indices to the float32 vector of entries."""
        if self.vpermps16:
            return self.permute(table(tirx.Ramp(tirx.const(0, "int32"), 1, 16)), index)   # table constant-folded
        return table(tirx.bitwise_and(index, tirx.Broadcast(tirx.const(15, "int32"), _lanes(index))))


def _lanes(v) -> int:
    return v.ty.dtype.lanes


def _f32(v):
    lanes = _lanes(v)
    return tirx.Cast("float32" if lanes == 1 else f"float32x{lanes}", v)


def _ints(value, like):
    return tirx.Broadcast(tirx.const(value, "int32"), _lanes(like))


def _nibble_value(offset: float):
    return lambda i: _f32(i) + tirx.Broadcast(tirx.const(offset, "float32"), _lanes(i))


def table_value(values):
    """The table function of 16 values for _Vectors.lookup: values[i] per int32 lane of i (0 <= i < 16) as float32, a
    select per bit, halving the table. On the vpermps tier `lookup` evaluates it once on the constant lanes 0..15
    (LLVM folds it to the table)."""
    assert len(values) == 16, values

    def value(i):
        picked = [tirx.Broadcast(tirx.const(float(v), "float32"), _lanes(i)) for v in values]
        for bit in range(4):
            odd = tirx.NE(tirx.bitwise_and(tirx.shift_right(i, _ints(bit, i)), _ints(1, i)), _ints(0, i))
            picked = [tirx.Select(odd, picked[2 * h + 1], picked[2 * h]) for h in range(len(picked) // 2)]
        return picked[0]

    return value


def _token(p, t, group: int, m: int):
    """Token of pass p's t-th accumulator set, clamped for loads (a partial last pass skips its stores)."""
    return T.min(p * group + t, m - 1)


def _lane_index(base, lanes: int, shift: int, step: int):
    """int32 vector base + (i >> shift) * step over lanes i: which table entry each lane reads."""
    ramp = tirx.Ramp(tirx.const(0, "int32"), 1, lanes)
    return tirx.Broadcast(tirx.Cast("int32", base), lanes) \
        + tirx.shift_right(ramp, _ints(shift, ramp)) * _ints(step, ramp)
