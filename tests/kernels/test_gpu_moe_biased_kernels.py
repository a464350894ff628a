"""gpt-oss's two-launch GPU expert kernels (schedules/gpu/moe_experts_biased.py) without a GPU: their generated CUDA
compiled with g++ against test_gpu_quant_kernels' harness (a std::thread per CUDA thread; test_gpu_moe_kernels'
_emulate, blockIdx.y looping over the selected experts). Reference: float64 on gguf's dequantization of the same
stacked rows, with the fp32 biases of the same slots and transformers' GptOssExperts' clamped SwiGLU; x is not
quantized (the fp32-activation GEMV), so the tolerance is fp32 sums and the one fp16 rounding of each output.
Experts are picked out of order and not all of them, so a CTA reading another slot's rows or biases is a large
error."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("tvm")
gguf_quants = pytest.importorskip("gguf.quants")

from helmc.runtime.function_names import gpu_moe_names, gpu_moe_rows_names  # noqa: E402
from helmc.schedules.gpu.moe_experts_biased import gpu_moe_biased_applies, make_gpu_moe_biased_kernels  # noqa: E402
from helmc.schedules.gpu.quant_gemv import gemv_parts  # noqa: E402
from test_cpu_quant_gemv import GGML, random_quant_weight  # noqa: E402
from test_gpu_moe_kernels import _emulate, _run  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
ALPHA = 1.702


def _experts(rng, gate_type, down_type, E, I, H):
    """Stacked raw rows (gate, up [E * I, gb], down [E * H, db]) and fp32 biases [E, I], [E, I], [E, H]."""
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))
    down = random_quant_weight(rng, down_type, E * H, I)
    b_gate, b_up = (rng.standard_normal((E, I)).astype(np.float32) * 0.5 for _ in range(2))
    b_down = rng.standard_normal((E, H)).astype(np.float32) * 0.5
    return dict(w_gate=gate, w_up=up, w_down=down, b_gate=b_gate, b_up=b_up, b_down=b_down)


def _deq(raw, qtype):
    return gguf_quants.dequantize(raw, GGML[qtype]).astype(np.float64)


def _scaled_x(rng, w, gate_type, I, H, m):
    """x [m, H] fp16 scaled so expert 0's gate sums have unit spread (the clamp's limits then mean something)."""
    x = rng.standard_normal((m, H))
    g = _deq(w["w_gate"][:I], gate_type) @ x[0]
    return (x / g.std()).astype(np.float16)


def _grids(gate_type, down_type, I, H):
    return gemv_parts(gate_type, I, H, span=2)[1], gemv_parts(down_type, H, I)[1]


def _reference_a(w, gate_type, e, x, I, limit):
    """Expert e's clamped SwiGLU on x [H] in float64, GptOssExperts' order; also whether each clamp bit."""
    x = x.astype(np.float64)
    g = _deq(w["w_gate"][e * I:(e + 1) * I], gate_type) @ x + w["b_gate"][e]
    u = _deq(w["w_up"][e * I:(e + 1) * I], gate_type) @ x + w["b_up"][e]
    gv, uv = np.minimum(g, limit), np.clip(u, -limit, limit)
    return (uv + 1) * (gv / (1 + np.exp(-ALPHA * gv))), bool((g > limit).any() and (np.abs(u) > limit).any())


@pytest.mark.parametrize("gate_type,down_type,limit", [("mxfp4", "mxfp4", 7.0), ("mxfp4", "mxfp4", 0.8),
                                                       ("q8_0", "mxfp4", 0.8)])
def test_selected_biased_experts_match_float64(tmp_path, gate_type, down_type, limit):
    E, I, H, K = 5, 96, 160, 3
    assert gpu_moe_biased_applies(gate_type, down_type, E, I, H)
    rng = np.random.default_rng(5)
    w = _experts(rng, gate_type, down_type, E, I, H)
    x = _scaled_x(rng, w, gate_type, I, H, 1)
    lib, params = _emulate(tmp_path, make_gpu_moe_biased_kernels(gate_type, down_type, E, I, H, K, ALPHA, limit))
    gate_up_name, down_name = (s + "_kernel" for s in gpu_moe_names(gate_type, down_type, E, I, H, biased=True))
    sel = np.array([4, 1, 2], np.int32)
    a, part = np.zeros((K, I), np.float16), np.zeros((K, H), np.float16)
    arrays = dict(x=x, sel=sel, a=a, part=part, **w)
    up_grid, down_grid = _grids(gate_type, down_type, I, H)
    _run(lib, params, gate_up_name, arrays, 2, up_grid)
    _run(lib, params, down_name, arrays, 2, down_grid)
    for j, e in enumerate(sel[:2]):
        ref_a, clamped = _reference_a(w, gate_type, e, x[0], I, limit)
        assert clamped == (limit < 1), (e, limit)        # the small limit bites on both gate and up
        err_a = np.abs(a[j].astype(np.float64) - ref_a).max() / np.abs(ref_a).max()
        ref_p = _deq(w["w_down"][e * H:(e + 1) * H], down_type) @ a[j].astype(np.float64) + w["b_down"][e]
        err_p = np.abs(part[j].astype(np.float64) - ref_p).max() / np.abs(ref_p).max()
        print(f"{gate_type}/{down_type} limit {limit} expert {e}: activation rel err {err_a:.1e}, down {err_p:.1e}")
        assert err_a < 2e-3 and err_p < 2e-3, (e, err_a, err_p)
    assert not a[2].any() and not part[2].any()          # n = 2: the third slot untouched


def test_biased_rows_kernels_equal_the_one_row_kernels_per_row(tmp_path):
    """A batched step's pairs: each pair's a and part are the one-row kernels' bits on that pair's row alone; rows
    share experts and pick others, so a CTA reading another row's x or another slot's biases is a changed bit."""
    gate_type = down_type = "mxfp4"
    E, I, H, K, limit = 5, 96, 160, 2, 0.8
    rng = np.random.default_rng(13)
    w = _experts(rng, gate_type, down_type, E, I, H)
    x = _scaled_x(rng, w, gate_type, I, H, 3)                                         # m = 3 rows
    funcs = {**make_gpu_moe_biased_kernels(gate_type, down_type, E, I, H, K, ALPHA, limit),
             **make_gpu_moe_biased_kernels(gate_type, down_type, E, I, H, K, ALPHA, limit, rows=True)}
    lib, params = _emulate(tmp_path, funcs)
    one_up, one_down = (s + "_kernel" for s in gpu_moe_names(gate_type, down_type, E, I, H, biased=True))
    rows_up, rows_down = (s + "_kernel" for s in gpu_moe_rows_names(gate_type, down_type, E, I, H, biased=True))
    up_grid, down_grid = _grids(gate_type, down_type, I, H)
    sel = np.array([4, 1, 1, 3, 0, 4], np.int32)                                     # [n] pairs' slots
    row = np.array([0, 0, 1, 1, 2, 2], np.int32)                                     # [n] their rows
    a, part = np.zeros((6, I), np.float16), np.zeros((6, H), np.float16)
    _run(lib, params, rows_up, dict(x=x, sel=sel, row=row, a=a, part=part, **w), 6, up_grid)
    _run(lib, params, rows_down, dict(x=x, sel=sel, row=row, a=a, part=part, **w), 6, down_grid)
    assert a.any() and part.any()
    for r in range(3):
        a1, p1 = np.zeros((K, I), np.float16), np.zeros((K, H), np.float16)
        one = dict(x=np.ascontiguousarray(x[r:r + 1]), sel=sel[2 * r:2 * r + 2].copy(), a=a1, part=p1, **w)
        _run(lib, params, one_up, one, K, up_grid)
        _run(lib, params, one_down, one, K, down_grid)
        assert np.array_equal(a[2 * r:2 * r + 2].view(np.uint16), a1.view(np.uint16)), r
        assert np.array_equal(part[2 * r:2 * r + 2].view(np.uint16), p1.view(np.uint16)), r


def test_biased_kernels_apply_to_gpt_oss_20b_shapes():
    """gpt-oss-20b: 32 MXFP4 experts of 2880 x 2880 (90 blocks of 32 along each k); a type the GEMV does not decode,
    or k not whole blocks, is not taken."""
    assert gpu_moe_biased_applies("mxfp4", "mxfp4", 32, 2880, 2880)
    assert not gpu_moe_biased_applies("q2_k", "mxfp4", 32, 2880, 2880)
    assert not gpu_moe_biased_applies("mxfp4", "mxfp4", 32, 2880, 2890)
