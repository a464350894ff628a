"""Batch-invariant batched decode on the CPU stage: a bundle built with --max-batch 4 holds decode_b2 and
decode_b4 variants of the block functions and the head, and a step of several sequences (one token each) runs
them on padded rows; every sequence's logits must equal, bit for bit, those of its single-request run (so its
greedy tokens do too), for fp16, bf16, Q4_K_M and Q8_0 weights, and for an AVX2 build (its GEMV carries the
batch in several passes over the rows). Tiny random-weight Qwen3 with K-quant-sized dimensions; real builds,
nothing mocked. A wider model (hidden 4096) checks the elementwise functions where the batched ones go
parallel and vectorised and the single-row ones stay serial."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batch_decode_checks import batched_runs, compare, prompts, single_runs
from tiny_shapes import KQUANT_DIMS

pytest.importorskip("tvm.relax")
AVX2 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse2")
STEPS = 12


@pytest.fixture(scope="module")
def cpu_hardware(host_hardware):
    return dataclasses.replace(host_hardware, gpu=None, link=None)


def _session(tmp_path, hw, cache_dir, dtype="float16", quant="", batch=4, arch="qwen3", **dims):
    """A bundle of its own: for a hardware profile or a model the session's shared bundles do not have."""
    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    model = str(tmp_path / "model")
    make_tiny_model(model, arch, dtype=dtype, **(dims or KQUANT_DIMS))
    r = api.build(model, hw, str(tmp_path / "bundle"), cache_dir=cache_dir, quiet=True, quant=quant, batch=batch)
    assert r.plan.workload.batch == batch and r.plan.placement.cpu_units == r.spec.num_units
    return Session.load(r.bundle_dir)


def _shared_session(tiny, dtype="float16", quant=""):
    """The session's shared batch-4 CPU bundle of the K-quant-sized Qwen3 (tests/serve/test_serve_warmup.py's too;
    the Q4_K_M and Q8_0 ones are tests/compiler/test_quantized_models.py's)."""
    from helmc.runtime.session import Session
    r = tiny.build("qwen3", dtype, batch=4, quant=quant, cpu_only=True, **KQUANT_DIMS)
    assert r.plan.workload.batch == 4 and r.plan.placement.cpu_units == r.spec.num_units
    return Session.load(r.bundle_dir)


@pytest.mark.parametrize("dtype,quant", [("float16", ""), ("bfloat16", ""), ("float16", "q4_k_m"), ("float16", "q8_0")])
def test_batched_decode_is_bitwise_single_decode(tiny, dtype, quant):
    if quant:
        pytest.importorskip("gguf")
    s = _shared_session(tiny, dtype, quant)
    vm = s.cpu_stage.vm
    for b in (2, 4):          # the variants, and what the stage and head were given of them
        for part in ("pre_attn", "post_attn", "head"):
            assert vm[f"{part}_decode_b{b}"] is not None
    assert s.cpu_stage.batch_sizes == (2, 4)
    ps = prompts(s.spec.vocab_size, 6)
    singles = single_runs(s, ps, STEPS)
    batched, sizes = batched_runs(s, ps, STEPS, max_batch=4, stagger=1)
    assert {1, 2, 3, 4} <= set(sizes), sizes          # padded (3 -> 4) and exact steps both ran
    compare(singles, batched, f"{dtype} {quant or 'unquantized'}")


def test_avx2_build_is_bitwise_too(tmp_path, cpu_hardware, cache_dir):
    from helmc.runtime.bundle.manifest import host_cpu_flags
    from helmc.schedules.cpu.isa import missing_flags, select_isa
    if missing_flags(select_isa(AVX2).required_flags, host_cpu_flags()):
        pytest.skip("this CPU cannot run the AVX2 tier")
    hw = dataclasses.replace(cpu_hardware, cpu=dataclasses.replace(cpu_hardware.cpu, features=AVX2))
    s = _session(tmp_path, hw, cache_dir)
    ps = prompts(s.spec.vocab_size, 5)
    compare(single_runs(s, ps, STEPS), batched_runs(s, ps, STEPS, max_batch=4, stagger=1)[0], "avx2 fp16")


@pytest.mark.slow
def test_wide_model_batch_of_8(tmp_path, cpu_hardware, cache_dir):
    """hidden 4096, 32 heads of 128: a decode_b8 step's norms and RoPE run parallel and vectorised
    (>= schedules/cpu/elementwise.PARALLEL_MIN_ELEMENTS), the one-row decode's serially."""
    s = _session(tmp_path, cpu_hardware, cache_dir, batch=8, num_layers=1, head_dim=128, hidden_size=4096,
                 intermediate_size=1024, num_attention_heads=32, num_key_value_heads=8)
    assert s.cpu_stage.batch_sizes == (2, 4, 8)
    ps = prompts(s.spec.vocab_size, 8)
    batched, sizes = batched_runs(s, ps, 6, max_batch=8, stagger=8)
    assert 8 in sizes
    compare(single_runs(s, ps, 6), batched, "wide fp16 batch 8")


def test_gemma3_geglu_batched_decode_is_bitwise(tmp_path, cpu_hardware, cache_dir):
    """Gemma 3's GeGLU (its tanh as fast_tanh's polynomial, passes/expand_gelu_tanh.py) and sandwich norms: with
    an intermediate of 8192 a decode_b4 step's GeGLU runs parallel and vectorised (>= PARALLEL_MIN_ELEMENTS), the
    one-row decode's serially, and each row's bits are still its single run's."""
    s = _session(tmp_path, cpu_hardware, cache_dir, arch="gemma3", num_layers=3, hidden_size=256,
                 intermediate_size=8192, num_attention_heads=4, num_key_value_heads=2)
    assert s.spec.hidden_act == "gelu_pytorch_tanh" and s.cpu_stage.batch_sizes == (2, 4)
    ps = prompts(s.spec.vocab_size, 4)
    batched, sizes = batched_runs(s, ps, 10, max_batch=4, stagger=4)
    assert 4 in sizes
    compare(single_runs(s, ps, 10), batched, "gemma3 fp16 GeGLU")


def test_padding_rows_change_nothing(tiny):
    """The batched variant's rows are independent: a row's output is the same whatever the other rows hold
    (zeros, as padding, or another sequence's values)."""
    import tvm.runtime
    s = _shared_session(tiny)
    vm, w = s.cpu_stage.vm, s.cpu_stage.bindings[0]
    rng = np.random.default_rng(1)
    H, D = s.spec.hidden_size, s.spec.head_dim
    x, ang = rng.standard_normal((4, H)).astype(np.float32), rng.uniform(0, 6, (4, D)).astype(np.float32)
    T = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a))  # noqa: E731
    full = [t.numpy() for t in vm["pre_attn_decode_b4"](T(x), T(np.cos(ang)), T(np.sin(ang)), *w.pre)]
    x[2:], ang[2:] = 0, 0
    padded = [t.numpy() for t in vm["pre_attn_decode_b4"](T(x), T(np.cos(ang)), T(np.sin(ang)), *w.pre)]
    one = [t.numpy() for t in vm["pre_attn_decode"](T(x[:1]), T(np.cos(ang[:1])), T(np.sin(ang[:1])), *w.pre)]
    for a, b, c in zip(full, padded, one):
        assert np.array_equal(a[:2], b[:2]) and np.array_equal(b[:1], c)
        assert np.isfinite(b).all()                  # zero rows through RMSNorm stay finite
