"""runtime/rope.RopeTables: a decode step's one position, served from a table of RopeTables.CHUNK positions, has the
bits of the one-position computation (the decode path's cos / sin before the table, which the compiled blocks and
the HF comparisons were checked on), across table boundaries and for each RoPE variant; and the rows handed out
are the caller's own."""
from __future__ import annotations

import numpy as np
import pytest

from helmc.model.spec import RopeSpec
from helmc.runtime.rope import RopeTables

VARIANTS = [RopeSpec(kind="default", theta=1_000_000.0),
            RopeSpec(kind="linear", theta=10_000.0, factor=4.0),
            RopeSpec(kind="llama3", theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position=8192)]


@pytest.mark.parametrize("rope", VARIANTS, ids=lambda r: r.kind)
def test_one_position_from_the_table_is_the_direct_computation(rope):
    tables, direct = RopeTables(rope, 128), RopeTables(rope, 128)
    chunk = RopeTables.CHUNK
    positions = [0, 1, 127, chunk - 1, chunk, chunk + 1, 5 * chunk - 1, 40_959, 3, 131_071]    # back and forth
    worst = 0.0
    for p in positions:
        cos, sin = tables.cos_sin(np.array([p]))
        want_cos, want_sin = direct._compute(np.array([p]))
        assert cos.shape == sin.shape == (1, 128) and cos.dtype == sin.dtype == np.float32
        worst = max(worst, float(np.abs(cos - want_cos).max()), float(np.abs(sin - want_sin).max()))
        assert np.array_equal(cos.view(np.uint32), want_cos.view(np.uint32)), (rope.kind, p)
        assert np.array_equal(sin.view(np.uint32), want_sin.view(np.uint32)), (rope.kind, p)
    print(f"{rope.kind}: {len(positions)} positions, max |table - direct| = {worst:.1e}")
    many = np.arange(10, 20)
    assert all(np.array_equal(a, b) for a, b in zip(tables.cos_sin(many), direct._compute(many)))


def test_rows_handed_out_are_copies():
    tables = RopeTables(VARIANTS[0], 64)
    cos, _ = tables.cos_sin(np.array([7]))
    cos[...] = 42.0
    again, _ = tables.cos_sin(np.array([7]))
    assert not np.any(again == 42.0)
