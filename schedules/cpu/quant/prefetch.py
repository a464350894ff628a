"""Software prefetch for the quantized decode GEMVs (gemv_quant.py, quant/gemv_int8.py): one prefetch per 64-byte
line of each row a thread reads next, ahead of the block being decoded. `tuning` is gemv_quant.QuantGemvTuning (its
prefetch_bytes and prefetch_locality; not imported: gemv_quant imports this module)."""
from __future__ import annotations

from tvm.script import tirx as T

_LINE = 64


def prefetch_macro(rows: int, block_bytes: int, row_bytes: int, tuning, n: int, ahead: int | None = None,
                   wrap_rows: int | None = None):
    """Macro prefetch(wf, first, b), wf the flat byte view of W (n rows): the bytes `ahead` (default
    tuning.prefetch_bytes) further along each row of the group than block b, or past the row end the same place in
    the same row of the next group, `wrap_rows` (default rows) further on (the rows the thread reads next); ahead is
    capped at one row, so one wrap covers it. One prefetch per 64-byte line: blocks under half a line prefetch every
    `every` blocks. Nothing when prefetch_bytes is 0.
    Every address stays inside W. Where W has room, the group's first row is clamped once (min(first, safe): the
    last groups prefetch earlier rows' bytes, which they do not need, instead of bytes past W), so each prefetch is
    one instruction whose row and line offsets are constants; the per-address clamp it replaces cost four scalar
    instructions per prefetch, ~12% of the Q4_K kernel's instructions at 8 rows (llvm-mca). Small W
    (tests' tiny models) keeps the per-address clamp."""
    ahead, every, lines, index = prefetch_plan(rows, block_bytes, row_bytes, tuning, n, ahead, wrap_rows)
    locality = tuning.prefetch_locality

    @T.macro
    def prefetch(wf, first, b):
        if ahead > 0:
            if b % every == 0:
                for r in T.unroll(rows):
                    for line in T.unroll(lines):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch", T.address_of(wf[
                            index(first, r, b, line, T.min, T.if_then_else)]), T.int32(0), T.int32(locality),
                            T.int32(1)))

    return prefetch


def prefetch_plan(rows: int, block_bytes: int, row_bytes: int, tuning, n: int,
                  ahead: int | None = None, wrap_rows: int | None = None):
    """(ahead, every, lines, index) of _prefetch: index(first, r, b, line, tmin, select) is the byte prefetched for
    row r of the group starting at `first`, block b, line `line`, built with tmin / select (T.min / T.if_then_else in
    the kernel, min and a conditional in tests/kernels/test_gemv_quant.py's bound check)."""
    ahead = min(tuning.prefetch_bytes if ahead is None else ahead, row_bytes) if tuning.prefetch_bytes else 0
    wrap_rows = wrap_rows or rows
    every = max(1, _LINE // block_bytes)
    lines = -(-block_bytes * every // _LINE)   # consecutive prefetched addresses stay <= one line apart
    # Highest address: row first + rows - 1 + wrap_rows - 1, at an offset under 2 rows + lines lines.
    safe = n - rows - wrap_rows - 1 - -(-lines * _LINE // row_bytes)

    def index(first, r, b, line, tmin, select):
        along = b * block_bytes + ahead + line * _LINE
        wrap = select(along >= row_bytes, (wrap_rows - 1) * row_bytes, 0)
        if safe >= 0:
            return (tmin(first, safe) + r) * row_bytes + along + wrap
        return tmin((first + r) * row_bytes + along + wrap, n * row_bytes - 1)

    return ahead, every, lines, index
