"""The loop order of the quantized m-row decode GEMVs (m > 1: a batched decode step), shared by gemv_quant.py's fp32-lane
kernel and gemv_int8.py: blocks of rows over K tiles of x, as gemv.TiledRows does for fp16/bf16 weights."""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.gemv import TILE_BLOCK_ROWS, X_TILE_BYTES, balanced_tile


def _sum(terms):
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _hsum(v):
    """Sum of the lanes of a float32 vector expression (once per row, after the K loop)."""
    return _sum([tirx.Shuffle([v], [i]) for i in range(v.ty.dtype.lanes)])


@dataclass(frozen=True)
class QuantTiles:
    """m > 1: gemv.TiledRows' loop order for the quantized GEMVs. A parallel step takes block_rows rows
    and walks K in tiles of tile_blocks blocks (about gemv.X_TILE_BYTES of every token's x, which each row group
    of the block then reads from L1: at m = 8 one row's pass read 8 tokens' x per block, 14-30x the bytes of its
    quants, from L2). The block's accumulators (acc: lanes per row and token; accm: 8, q4_k's mins) stay in
    memory between tiles; each token's sums are formed as the m = 1 kernel forms them (bit-identical rows)."""
    rows: int          # rows per group (quant_blocking)
    group: int         # tokens per pass (quant_blocking)
    block_rows: int
    tile_blocks: int
    lanes: int         # fp32 lanes of acc

    @staticmethod
    def make(rows: int, group: int, m: int, blocks: int, x_block_bytes: int, lanes: int) -> "QuantTiles":
        """rows, group: gemv_quant.quant_blocking's; blocks per row; x_block_bytes: one token's x bytes read per
        block of weights."""
        return QuantTiles(rows, group, -(-TILE_BLOCK_ROWS // rows) * rows,
                          balanced_tile(blocks, X_TILE_BYTES // (m * x_block_bytes)), lanes)

    def passes(self, m: int) -> int:
        return -(-m // self.group)

    def macros(self, m: int, mins: bool):
        """(zero(accs, accms), load(accs, accms, acc, accm, rg, p), save(...same), finish(accs, accms, y, n,
        first)): accs / accms [block_rows, passes * group, lanes / 8]; finish writes y as the m = 1 kernel does:
        sum of acc's lanes (_hsum), minus accm's where the kernel has mins."""
        rows, group, rb, lanes = self.rows, self.group, self.block_rows, self.lanes
        slots = self.passes(m) * group

        @T.macro
        def zero(accs, accms):
            for r in T.serial(rb):
                for t in T.serial(slots):
                    accs[r, t, tirx.Ramp(0, 1, lanes)] = tirx.Broadcast(T.float32(0), lanes)
                    accms[r, t, tirx.Ramp(0, 1, 8)] = tirx.Broadcast(T.float32(0), 8)

        @T.macro
        def load(accs, accms, acc, accm, rg, p):
            for t in T.unroll(group):
                for r in T.unroll(rows):
                    acc[t, r, tirx.Ramp(0, 1, lanes)] = accs[rg * rows + r, p * group + t, tirx.Ramp(0, 1, lanes)]
                    accm[t, r, tirx.Ramp(0, 1, 8)] = accms[rg * rows + r, p * group + t, tirx.Ramp(0, 1, 8)]

        @T.macro
        def save(accs, accms, acc, accm, rg, p):
            for t in T.unroll(group):
                for r in T.unroll(rows):
                    accs[rg * rows + r, p * group + t, tirx.Ramp(0, 1, lanes)] = acc[t, r, tirx.Ramp(0, 1, lanes)]
                    accms[rg * rows + r, p * group + t, tirx.Ramp(0, 1, 8)] = accm[t, r, tirx.Ramp(0, 1, 8)]

        @T.macro
        def finish(accs, accms, y, n, first):
            for r in T.serial(rb):
                if first + r < n:
                    for t in T.serial(m):
                        if mins:
                            y[t, first + r] = _hsum(accs[r, t, tirx.Ramp(0, 1, lanes)]) - _hsum(
                                accms[r, t, tirx.Ramp(0, 1, 8)])
                        else:
                            y[t, first + r] = _hsum(accs[r, t, tirx.Ramp(0, 1, lanes)])

        return zero, load, save, finish
