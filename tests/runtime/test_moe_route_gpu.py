"""A prompt's routing on the GPU (moe_decode_row.route_rows: helmc_moe_route, one block a row; route_rows_to_host
for the CPU's experts) picks what the host's route() picks, in its order (largest first, ties to the lower index),
with its weights to rounding; the pairs group on the device (moe_prefill.group_pairs with CuPy) into NumPy's arrays,
bit for bit; and a block's prompt routed and grouped on the device (ExpertPrefill.add_routed) adds what the
host-routed path adds.

Needs only CuPy and a CUDA device for the first two; the last uses the q4_k_m bundle of tests/runtime/test_moe_gpu.py
(`python -m tests.device.build_moe_gpu_bundles .devrt/moe_gpu` on the compiler machine, carried with .devrt).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from helmc.model.moe import MoeSpec
from tests.gpu_prebuilt import cuda_device

pytestmark = pytest.mark.gpu


def grid_logits(rng, S: int, E: int, overflowed: bool = True) -> np.ndarray:
    """Router rows whose values tie exactly or differ by far more than rounding (a 1/256 grid: exp's last bits,
    which differ between NumPy and CUDA, cannot reorder them): random rows, rows of a few values (ties inside the
    top k and at its boundary), rows all equal, rows with a NaN or an inf logit (route() picks experts 0..k-1 there,
    NaN weights: the GPU must pick the same, or a prompt's routing statistics miss what decode selects)."""
    x = rng.integers(-1024, 1024, (S, E)).astype(np.float32) / np.float32(256)
    x[1::5] = rng.integers(-2, 3, (len(x[1::5]), E)).astype(np.float32)       # five values: ties everywhere
    x[2::7, : E // 2] = x[2::7, E // 2: 2 * (E // 2)]                         # each value twice
    x[3::11] = np.float32(0.75)                                               # one value: the first k
    if overflowed:
        x[4::13, E // 3] = np.nan                                             # an overflowed logit: a row of NaN
        x[6::17, -1] = np.inf                                                 # inf - inf: NaN too
    return x


@pytest.mark.parametrize("E,k,norm", [(8, 2, True), (128, 8, True), (128, 8, False), (60, 4, True),
                                      (1024, 64, True), (33, 33, False)])
def test_gpu_routing_picks_what_route_picks(E, k, norm):
    cp = cuda_device()
    from helmc.runtime.moe_decode_row import gpu_routes, route_rows, route_rows_to_host
    from helmc.runtime.moe_experts import route
    moe = MoeSpec(num_experts=E, top_k=k, norm_topk_prob=norm, expert_intermediate_size=16)
    assert gpu_routes(moe)
    logits = grid_logits(np.random.default_rng(E + k), 2048, E)
    want_idx, want_w = route(logits, moe)
    sel, w = route_rows(cp.asarray(logits), moe)
    assert sel.dtype == cp.int32 and w.dtype == cp.float32 and sel.shape == (2048, k) and w.shape == (2048, k)
    got_idx, got_w = sel.get(), w.get()
    bad = np.nonzero((got_idx != want_idx).any(axis=1))[0]
    assert bad.size == 0, (bad[:5], got_idx[bad[:2]], want_idx[bad[:2]], logits[bad[:2]])
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=0)
    if norm:
        finite = np.isfinite(logits).all(axis=1)
        assert 0 < (~finite).sum() < len(finite) and np.isnan(got_w[~finite]).all()
        np.testing.assert_allclose(got_w[finite].sum(axis=1), 1.0, rtol=1e-5)
    # brought back for the CPU's experts: route()'s dtypes, the device's values
    host_idx, host_w = route_rows_to_host(cp.asarray(logits), moe)
    assert host_idx.dtype == want_idx.dtype and host_w.dtype == np.float32
    assert np.array_equal(host_idx, want_idx) and np.array_equal(host_w, got_w, equal_nan=True)


def test_gpu_routing_is_declined_where_the_kernel_cannot_route():
    from helmc.runtime.moe_decode_row import gpu_routes
    assert not gpu_routes(MoeSpec(num_experts=2048, top_k=8, norm_topk_prob=True, expert_intermediate_size=16))
    assert not gpu_routes(MoeSpec(num_experts=256, top_k=65, norm_topk_prob=True, expert_intermediate_size=16))


@pytest.mark.parametrize("S,E,k", [(2048, 128, 8), (1, 8, 2), (300, 8, 8), (77, 1024, 64)])
def test_device_grouping_is_numpys(S, E, k):
    cp = cuda_device()
    from helmc.runtime.moe_decode_row import route_rows
    from helmc.runtime.moe_prefill import group_pairs
    moe = MoeSpec(num_experts=E, top_k=k, norm_topk_prob=True, expert_intermediate_size=16)
    sel, w = route_rows(cp.asarray(grid_logits(np.random.default_rng(S), S, E)), moe)
    got, want = group_pairs(sel, w, E, cp), group_pairs(sel.get(), w.get(), E)
    assert isinstance(got.starts, np.ndarray) and np.array_equal(got.starts, want.starts)
    for f in ("rows", "pos", "weights"):
        a, b = getattr(got, f), getattr(want, f)
        assert isinstance(a, cp.ndarray) and a.dtype == b.dtype and a.flags.c_contiguous, f
        assert np.array_equal(a.get(), b, equal_nan=True), f                    # NaN weights of NaN rows
    assert got.used() == sorted(set(sel.get().ravel().tolist()))


@pytest.mark.parametrize("vram", [((0, 3), (), (5,)), (tuple(range(8)), (), tuple(range(8)))])
def test_a_prompt_routed_on_the_gpu_adds_what_the_host_routed_prompt_adds(vram):
    """ExpertPrefill.add_routed (device logits routed and grouped on the GPU) against add_experts over route()'s
    picks of the same logits: the same picks, the same pairs run, sums within the weights' rounding."""
    cp = cuda_device()
    from tests.runtime.test_moe_gpu import moe_dir, reference

    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.cuda_runtime import tvm_stream
    from helmc.runtime.moe_experts import route
    from helmc.runtime.moe_prefill import expert_slot_bytes
    from helmc.runtime.session import Session
    d = moe_dir()
    weights, _ = reference(d, "gpu_q4_k_m")
    plan = Plan.from_json(open(os.path.join(d, "gpu_q4_k_m", "plan.json")).read()).replace(gpu_experts=vram)
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights, plan=plan)
    staging = 2 * expert_slot_bytes(s.gpu.stage.bindings[0].post[-1], 8)
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights,
                     plan=plan.replace(expert_staging_bytes=staging))
    prefill, experts = s.gpu.stage._moe.prefill, s.gpu.stage.bindings[0].post[-1]
    assert prefill.applies(experts)
    rng = np.random.default_rng(1)
    S, H = 300, s.spec.hidden_size
    logits = grid_logits(rng, S, 8, overflowed=False)          # finite sums to compare (NaN rows: the test above)
    m = cp.asarray(rng.standard_normal((S, H)).astype(np.float16))
    h = cp.asarray(rng.standard_normal((S, H)).astype(np.float32))
    with s.gpu.stream, tvm_stream(s.gpu.stream):
        got = h.copy()
        idx, g = prefill.add_routed(m, cp.asarray(logits), experts, got)
        want = h.copy()
        host_idx, host_w = route(logits, s.spec.moe)
        prefill.add_experts(m, host_idx, host_w, experts, want)
        s.gpu.stream.synchronize()
    assert isinstance(idx, cp.ndarray) and np.array_equal(idx.get(), host_idx)
    assert np.array_equal(g.counts(), np.bincount(host_idx.ravel(), minlength=8))
    diff = float(cp.abs(got - want).max() / cp.abs(want - h).max())
    print(f"\nGPU-routed prompt block vs host-routed: max diff {diff:.2e} of the experts' sum")
    assert float(cp.abs(got - h).max()) > 0 and diff < 1e-5
