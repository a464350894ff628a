"""The one-call MoE expert sum (schedules/cpu/quant/moe_experts.py) against float64: every selected expert's
down(silu(gate(x)) * up(x)) on gguf's dequantized weights, weighted and summed.

The kernel's GEMVs multiply int8 activations (quant/gemv_int8.py), so the reference quantizes x, and each
expert's SwiGLU output, the way the kernel does (test_cpu_quant_gemv.int8_activations) before multiplying in
float64. Experts are picked out of order and not all of them, so a step reading the wrong expert's rows, or an
expert summed twice, is a large error."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
gguf_quants = pytest.importorskip("gguf.quants")

from helmc.runtime.bundle.manifest import host_cpu_flags  # noqa: E402
from helmc.schedules.cpu.isa import select_isa  # noqa: E402
from helmc.schedules.cpu.quant.moe_experts import (BiasedExperts, make_moe_expert_sum,  # noqa: E402
                                                   moe_expert_sum_applies)
from tests.kernels.test_cpu_quant_gemv import GGML, int8_activations, random_quant_weight, target  # noqa: E402

ISA = select_isa(host_cpu_flags())
needs_avx512 = pytest.mark.skipif(ISA.tier != "avx512", reason="the int8 expert kernels need AVX-512")


def reference(x, sel, weight, gate, up, down, gate_type, down_type, inter, hidden):
    """float64 sum over j of weight[j] * expert sel[j], with the kernel's int8 rounding of its inputs."""
    deq = lambda raw, t: gguf_quants.dequantize(raw, GGML[t]).astype(np.float64)   # noqa: E731
    x8 = int8_activations(x, gate_type)[0]                                           # [1, H] -> [H]
    y = np.zeros(hidden)
    for e, w in zip(sel, weight):
        rows = slice(e * inter, (e + 1) * inter)
        g, u = deq(gate[rows], gate_type) @ x8, deq(up[rows], gate_type) @ x8      # [I] each
        a = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        y += w * (deq(down[e * hidden:(e + 1) * hidden], down_type) @ int8_activations(a[None], down_type)[0])
    return y


@needs_avx512
@pytest.mark.parametrize("gate_type,down_type,I,H", [("q4_k", "q6_k", 512, 768), ("q4_k", "q4_k", 512, 768),
                                                     ("q4_0", "q4_0", 512, 768), ("mxfp4", "mxfp4", 512, 768),
                                                     ("mxfp4", "mxfp4", 320, 2880)])   # gpt-oss's hidden size
def test_expert_sum_matches_float64(gate_type, down_type, I, H):
    E, K = 6, 3
    rng = np.random.default_rng(len(gate_type + down_type))
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))    # [E * I, row bytes]
    down = random_quant_weight(rng, down_type, E * H, I)                             # [E * H, row bytes]
    x = rng.standard_normal((1, H)).astype(np.float32)
    assert moe_expert_sum_applies(gate_type, down_type, I, H, ISA)
    func = make_moe_expert_sum(gate_type, down_type, E, I, H, K, ISA)
    lib = tvm.compile(func, target=target(ISA))
    call = lib[str(func.attrs["global_symbol"])]
    dev = tvm.cpu()
    w_gate, w_up, w_down = (tvm.runtime.tensor(w, dev) for w in (gate, up, down))
    for sel in ([1, 4, 5], [5], [0, 2]):
        weight = rng.uniform(0.1, 1.0, len(sel)).astype(np.float32)
        y = tvm.runtime.empty((1, H), "float32", dev)
        call(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(np.array(sel, np.int32), dev),
             tvm.runtime.tensor(weight, dev), w_gate, w_up, w_down, y)
        ref = reference(x, sel, weight, gate, up, down, gate_type, down_type, I, H)
        err = float(np.abs(y.numpy()[0] - ref).max() / np.abs(ref).max())
        print(f"{gate_type}/{down_type} experts {sel}: rel err {err:.2e}")
        assert err < 1e-5, (sel, err)


@needs_avx512
def test_more_experts_than_top_k_is_refused():
    E, I, H, K = 3, 256, 256, 2
    func = make_moe_expert_sum("q4_k", "q4_k", E, I, H, K, ISA)
    lib = tvm.compile(func, target=target(ISA))
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    gate = tvm.runtime.tensor(random_quant_weight(rng, "q4_k", E * I, H), dev)
    down = tvm.runtime.tensor(random_quant_weight(rng, "q4_k", E * H, I), dev)
    with pytest.raises(Exception, match="top-k"):
        lib[str(func.attrs["global_symbol"])](
            tvm.runtime.tensor(np.ones((1, H), np.float32), dev), tvm.runtime.tensor(np.arange(3, dtype=np.int32), dev),
            tvm.runtime.tensor(np.ones(3, np.float32), dev), gate, gate, down, tvm.runtime.empty((1, H), "float32", dev))


def reference_biased(x, sel, weight, gate, up, down, biases, alpha, limit, gate_type, down_type, inter, hidden):
    """float64 sum over j of weight[j] * (gpt-oss's expert sel[j] + its down bias), the kernel's int8 rounding of its
    inputs: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), each with its bias."""
    deq = lambda raw, t: gguf_quants.dequantize(raw, GGML[t]).astype(np.float64)   # noqa: E731
    b_gate, b_up, b_down = biases
    x8 = int8_activations(x, gate_type)[0]
    y = np.zeros(hidden)
    for e, w in zip(sel, weight):
        rows = slice(e * inter, (e + 1) * inter)
        g = np.minimum(deq(gate[rows], gate_type) @ x8 + b_gate[e], limit)
        u = np.clip(deq(up[rows], gate_type) @ x8 + b_up[e], -limit, limit)
        a = ((u + 1) * g / (1 + np.exp(-alpha * g))).astype(np.float32)
        y += w * (deq(down[e * hidden:(e + 1) * hidden], down_type) @ int8_activations(a[None], down_type)[0] + b_down[e])
    return y


def biased_case(rng, gate_type, down_type, E, I, H):
    """Random weights, biases and an input for the biased kernels, and a limit the gate and up values cross often."""
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))
    down = random_quant_weight(rng, down_type, E * H, I)
    biases = tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((E, I), (E, I), (E, H)))
    x = rng.standard_normal((1, H)).astype(np.float32)
    g = gguf_quants.dequantize(gate[:I], GGML[gate_type]) @ int8_activations(x, gate_type)[0]
    return gate, up, down, biases, x, float(np.percentile(np.abs(g), 60))


@needs_avx512
@pytest.mark.parametrize("gate_type,down_type,I,H", [("mxfp4", "mxfp4", 320, 2880), ("q4_k", "q6_k", 512, 768)])
def test_biased_expert_sum_matches_float64(gate_type, down_type, I, H):
    """gpt-oss's experts in one call: the biases and the clamped SwiGLU (limit where ~40% of the gate values clamp)."""
    E, K, alpha = 5, 4, 1.702
    rng = np.random.default_rng(7)
    gate, up, down, biases, x, limit = biased_case(rng, gate_type, down_type, E, I, H)
    func = make_moe_expert_sum(gate_type, down_type, E, I, H, K, ISA, BiasedExperts(alpha, limit))
    assert str(func.attrs["global_symbol"]).endswith("_biased")
    assert [str(p.name) for p in func.params][6:9] == ["b_gate", "b_up", "b_down"]   # after the weights, before y
    call = tvm.compile(func, target=target(ISA))[str(func.attrs["global_symbol"])]
    dev = tvm.cpu()
    args = tuple(tvm.runtime.tensor(w, dev) for w in (gate, up, down) + biases)
    for sel in ([0, 2, 3, 4], [4], [1, 3]):
        weight = rng.uniform(0.1, 1.0, len(sel)).astype(np.float32)
        y = tvm.runtime.empty((1, H), "float32", dev)
        call(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(np.array(sel, np.int32), dev),
             tvm.runtime.tensor(weight, dev), *args, y)
        ref = reference_biased(x, sel, weight, gate, up, down, biases, alpha, limit, gate_type, down_type, I, H)
        err = float(np.abs(y.numpy()[0] - ref).max() / np.abs(ref).max())
        print(f"biased {gate_type}/{down_type} experts {sel}: rel err {err:.2e}")
        assert err < 1e-5, (sel, err)
