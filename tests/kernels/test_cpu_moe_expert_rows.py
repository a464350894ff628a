"""The m-row MoE expert sum (schedules/cpu/quant/moe_experts_rows.py): every row of a batched decode step against
float64 (test_cpu_moe_expert_sum.reference) and bit for bit against the one-row kernel on that row alone.

The rows share some experts and not others, and pick them out of order, so an expert's rows run for the wrong row,
a pair's weight on another pair, or a row summing another row's experts is a large error or a changed bit."""
from __future__ import annotations

import functools

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("gguf.quants")

from helmc.runtime.moe_experts import expert_rows_args  # noqa: E402
from helmc.schedules.cpu.quant.moe_experts import make_moe_expert_sum  # noqa: E402
from helmc.schedules.cpu.quant.moe_experts_rows import PAIR_TILE, make_moe_expert_rows, pair_tile  # noqa: E402
from tests.kernels.test_cpu_moe_expert_sum import ISA, needs_avx512, reference  # noqa: E402
from tests.kernels.test_cpu_quant_gemv import random_quant_weight, target  # noqa: E402


def _compiled(func):
    lib = tvm.compile(func, target=target(ISA))
    return lib[str(func.attrs["global_symbol"])]


@functools.lru_cache(maxsize=None)
def _compiled_once(kind, gate_type, down_type, E, I, H, K, biased, tile):
    make = make_moe_expert_rows if kind == "rows" else make_moe_expert_sum
    return _compiled(make(gate_type, down_type, E, I, H, K, ISA, biased, **({"tile": tile} if kind == "rows" else {})))


def _rows_kernel(gate_type, down_type, E, I, H, K, biased=None, tile=None):
    """The m-row kernel for these types and shapes, compiled once for this module: the tests that check the same
    kernel on other rows (mixed experts, tiled groups) call the same compiled code (a compile takes ~5-15 s on 2
    cores); only the inputs passed to it differ."""
    return _compiled_once("rows", gate_type, down_type, E, I, H, K, biased, tile or pair_tile(gate_type))


def _one_row_kernel(gate_type, down_type, E, I, H, K, biased=None):
    """The one-row kernel the m-row kernel's rows are compared with, compiled once for this module likewise."""
    return _compiled_once("one", gate_type, down_type, E, I, H, K, biased, None)


def _kernels(gate_type, down_type, E, I, H, K, biased=None):
    return _rows_kernel(gate_type, down_type, E, I, H, K, biased), _one_row_kernel(gate_type, down_type, E, I, H, K,
                                                                                  biased)


def _rows_call(call, x, idx, w, weights, dev):
    """y [m, H] of the m-row kernel on rows x [m, H] whose selected experts are idx [m, k] with weights w [m, k]."""
    args = [tvm.runtime.tensor(a, dev) for a in expert_rows_args(idx, w)]
    y = tvm.runtime.empty(x.shape, "float32", dev)
    call(tvm.runtime.tensor(x, dev), *args, *weights, y)
    return y.numpy()


def _one_row(call, x_row, sel, weight, weights, dev):
    order = np.argsort(sel, kind="stable")
    y = tvm.runtime.empty((1, x_row.shape[-1]), "float32", dev)
    call(tvm.runtime.tensor(x_row[None], dev), tvm.runtime.tensor(sel[order].astype(np.int32), dev),
         tvm.runtime.tensor(weight[order].astype(np.float32), dev), *weights, y)
    return y.numpy()[0]


@needs_avx512
@pytest.mark.parametrize("gate_type,down_type", [("q4_k", "q6_k"), ("q4_0", "q4_0")])
def test_expert_rows_match_one_row_and_float64(gate_type, down_type):
    E, I, H, K = 6, 256, 512, 3
    rng = np.random.default_rng(7 + len(gate_type + down_type))
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))    # [E * I, row bytes]
    down = random_quant_weight(rng, down_type, E * H, I)                             # [E * H, row bytes]
    dev = tvm.cpu()
    weights = [tvm.runtime.tensor(w, dev) for w in (gate, up, down)]
    rows, one = _kernels(gate_type, down_type, E, I, H, K)
    for idx in ([[4, 1, 5], [1, 0, 2], [5, 4, 1], [3, 2, 0], [1, 5, 4]], [[2, 0, 5]], [[0, 3, 1], [3, 0, 1]]):
        idx = np.array(idx, np.int64)                                               # [m, K], largest first
        w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
        x = rng.standard_normal((idx.shape[0], H)).astype(np.float32)
        y = _rows_call(rows, x, idx, w, weights, dev)
        for r in range(idx.shape[0]):
            alone = _one_row(one, x[r], idx[r], w[r], weights, dev)
            assert np.array_equal(y[r].view(np.uint32), alone.view(np.uint32)), (idx.tolist(), r)
            ref = reference(x[r:r + 1], idx[r], w[r], gate, up, down, gate_type, down_type, I, H)
            err = float(np.abs(y[r] - ref).max() / np.abs(ref).max())
            assert err < 1e-5, (idx.tolist(), r, err)


@needs_avx512
def test_rows_with_some_pairs_left_out():
    """A step where rows hand some experts to another device (the GPU's VRAM share): fewer pairs than m * k, a row
    with none at all gets zeros, the others equal the one-row kernel on the pairs they kept. The kernels are
    test_expert_rows_match_one_row_and_float64's q4_k/q6_k pair (compiled once for the module): which pairs a row
    keeps is in the pair list the kernel reads, not in its types or shapes."""
    E, I, H, K = 6, 256, 512, 3
    rng = np.random.default_rng(3)
    gate, up = (random_quant_weight(rng, "q4_k", E * I, H) for _ in range(2))
    down = random_quant_weight(rng, "q6_k", E * H, I)
    dev = tvm.cpu()
    weights = [tvm.runtime.tensor(w, dev) for w in (gate, up, down)]
    rows, one = _kernels("q4_k", "q6_k", E, I, H, K)
    idx = np.array([[3, 1, 5], [2, 0, 4], [1, 3, 0], [4, 5, 2]], np.int64)
    w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    keep = np.array([[True, False, False], [False, False, False], [True, True, True], [False, True, True]])
    x = rng.standard_normal((len(idx), H)).astype(np.float32)
    args = [tvm.runtime.tensor(a, dev) for a in expert_rows_args(idx, w, keep)]
    y = tvm.runtime.empty((len(idx), H), "float32", dev)
    rows(tvm.runtime.tensor(x, dev), *args, *weights, y)
    y = y.numpy()
    assert not y[1].any()
    for r in (0, 2, 3):
        assert np.array_equal(y[r], _one_row(one, x[r], idx[r, keep[r]], w[r, keep[r]], weights, dev)), r


@needs_avx512
def test_biased_expert_rows_match_one_row_and_float64():
    """gpt-oss's experts (biases, clamped SwiGLU) in the m-row kernel: each row bit-identical to the one-row biased
    kernel and within float64's reach (tests/kernels/test_cpu_moe_expert_sum.reference_biased)."""
    from helmc.schedules.cpu.quant.moe_experts import BiasedExperts
    from tests.kernels.test_cpu_moe_expert_sum import biased_case, reference_biased
    E, I, H, K, alpha = 6, 256, 512, 3, 1.702
    rng = np.random.default_rng(11)
    gate, up, down, biases, _, limit = biased_case(rng, "mxfp4", "mxfp4", E, I, H)
    dev = tvm.cpu()
    weights = [tvm.runtime.tensor(w, dev) for w in (gate, up, down) + biases]
    rows, one = _kernels("mxfp4", "mxfp4", E, I, H, K, BiasedExperts(alpha, limit))
    for idx in ([[4, 1, 5], [1, 0, 2], [5, 4, 1], [3, 2, 0]], [[2, 0, 5]]):
        idx = np.array(idx, np.int64)
        w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
        x = rng.standard_normal((idx.shape[0], H)).astype(np.float32)
        y = _rows_call(rows, x, idx, w, weights, dev)
        for r in range(idx.shape[0]):
            alone = _one_row(one, x[r], idx[r], w[r], weights, dev)
            assert np.array_equal(y[r].view(np.uint32), alone.view(np.uint32)), (idx.tolist(), r)
            order = np.argsort(idx[r], kind="stable")
            ref = reference_biased(x[r:r + 1], idx[r][order], w[r][order], gate, up, down, biases, alpha, limit,
                                   "mxfp4", "mxfp4", I, H)
            assert float(np.abs(y[r] - ref).max() / np.abs(ref).max()) < 1e-5, (idx.tolist(), r)


def _tiled_groups(tile: int) -> np.ndarray:
    """idx [2 * tile + 1, 3] whose experts 0 .. 5 are chosen by 2 * tile + 1, tile + 1, tile, tile - 1, 1 and
    tile + 1 rows: full tiles of one expert's pairs, remainders of a smaller tile or one pair alone, each row's
    experts in a shuffled order."""
    m = 2 * tile + 1
    idx = np.zeros((m, 3), np.int64)
    idx[:, 1] = np.where(np.arange(m) <= tile, 1, 2)
    idx[:, 2] = np.where(np.arange(m) < tile - 1, 3, np.where(np.arange(m) == tile - 1, 4, 5))
    rng = np.random.default_rng(tile)
    return np.stack([rng.permutation(row) for row in idx])


@needs_avx512
@pytest.mark.parametrize("gate_type,down_type", [("q4_k", "q6_k"), ("q5_k", "q3_k"), ("q4_0", "q4_0")])
def test_tiles_of_one_experts_pairs_match_one_row(gate_type, down_type):
    """Rows sharing experts in groups that fill whole tiles of pairs (gate/up decoded once per tile), leave a
    smaller tile or a single pair: every row bit-identical to the one-row kernel on that row alone. Tile 8: 51 pairs
    of 6 experts, so down runs expert by expert in the same tiles; tile 2 (Qwen3-MoE's types): 15 pairs, down row by
    row. The tiles run each type's m-token step, which test_cpu_gemv_rows checks row by row for every type; here
    each type in one role (three compiles a pair took ~28 s on the 2-core CI machine)."""
    E, I, H, K = 6, 256, 512, 3
    rng = np.random.default_rng(len(gate_type + down_type))
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))
    down = random_quant_weight(rng, down_type, E * H, I)
    dev = tvm.cpu()
    weights = [tvm.runtime.tensor(w, dev) for w in (gate, up, down)]
    one = _one_row_kernel(gate_type, down_type, E, I, H, K)
    for tile in sorted({2, PAIR_TILE} if (gate_type, down_type) == ("q4_k", "q6_k") else {pair_tile(gate_type)}):
        rows = _rows_kernel(gate_type, down_type, E, I, H, K, tile=tile)
        idx = _tiled_groups(tile)
        assert np.bincount(idx.ravel()).tolist() == [2 * tile + 1, tile + 1, tile, tile - 1, 1, tile + 1]
        w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
        x = rng.standard_normal((idx.shape[0], H)).astype(np.float32)
        y = _rows_call(rows, x, idx, w, weights, dev)
        for r in range(idx.shape[0]):
            alone = _one_row(one, x[r], idx[r], w[r], weights, dev)
            assert np.array_equal(y[r].view(np.uint32), alone.view(np.uint32)), (tile, r)


@needs_avx512
def test_biased_tiles_of_one_experts_pairs_match_one_row():
    """gpt-oss's experts (MXFP4, biases) with the tiled groups (down expert by expert too): each row bit-identical to
    the one-row biased kernel. The weights and limit are test_biased_expert_rows_match_one_row_and_float64's (the
    limit is compiled into the kernels, so both tests run the same compiled pair); the rows and inputs are this
    test's."""
    from helmc.schedules.cpu.quant.moe_experts import BiasedExperts
    from tests.kernels.test_cpu_moe_expert_sum import biased_case
    E, I, H, K = 6, 256, 512, 3
    gate, up, down, biases, _, limit = biased_case(np.random.default_rng(11), "mxfp4", "mxfp4", E, I, H)
    rng = np.random.default_rng(13)
    dev = tvm.cpu()
    weights = [tvm.runtime.tensor(w, dev) for w in (gate, up, down) + biases]
    rows, one = _kernels("mxfp4", "mxfp4", E, I, H, K, BiasedExperts(1.702, limit))
    idx = _tiled_groups(pair_tile("mxfp4"))                   # the tile its kernels are built with
    w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    x = rng.standard_normal((idx.shape[0], H)).astype(np.float32)
    y = _rows_call(rows, x, idx, w, weights, dev)
    for r in range(idx.shape[0]):
        alone = _one_row(one, x[r], idx[r], w[r], weights, dev)
        assert np.array_equal(y[r].view(np.uint32), alone.view(np.uint32)), r
