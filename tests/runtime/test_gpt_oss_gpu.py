"""gpt-oss on the GPU stage (attention with its sinks, o_proj's and the router's biases, the topk_softmax routing on
the GPU) with its biased, clamped experts on the CPU, in VRAM, or both, against Hugging Face transformers in fp32 on
a tiny random GptOssForCausalLM (4 blocks, window 8 on blocks 0 and 2, 8 experts, top-3).

The bundles are built on the compiler machine by
    python -m tests.device.build_gpt_oss_gpu_bundles .devrt/gpt_oss_gpu
and carried to the GPU machine; the tests look in $HELMC_GPT_OSS_GPU_DIR (default .devrt/gpt_oss_gpu). They import
no compiler.

Pass (the other GPU MoE tests' rule): 16 greedy tokens identical to transformers', or at the first divergence each
side's token in the other's top 5; prefill logits within 2e-2 of transformers' max (the GPU stage's activations are
fp16); a batched decode step of several sequences bit-identical per sequence to their single runs.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu_prebuilt import prebuilt_dir
from tests.runtime.test_moe_gpu import NEW_TOKENS, PROMPT, check_divergence, hf_greedy

pytestmark = pytest.mark.gpu

LAYERS, EXPERTS = 4, 8
HOST = ((),) * LAYERS
ALL_VRAM = (tuple(range(EXPERTS)),) * LAYERS
MIXED = ((0, 3, 5), (), (1, 2, 6, 7), (4,))


def oss_dir(bundle: str) -> str:
    """The bundles' folder, once it holds `bundle` and a CUDA device is here; else the test skips."""
    return prebuilt_dir("HELMC_GPT_OSS_GPU_DIR", "gpt_oss_gpu", os.path.join(bundle, "manifest.json"),
                        f"gpt-oss GPU bundle {bundle}", "build_gpt_oss_gpu_bundles .devrt/gpt_oss_gpu")


def reference(d: str, name: str):
    """(weights for the bundle, transformers in fp32 over the same weights)."""
    if name == "gpu_mxfp4":
        pytest.importorskip("gguf")         # the reference dequantizes with llama.cpp's own gguf package
        from helmc.testing import hf_on_gpt_oss_gguf
        path = os.path.join(d, "gpt-oss-mxfp4.gguf")
        return path, hf_on_gpt_oss_gguf(os.path.join(d, "model_gguf"), path)
    from helmc.testing import hf_reference
    model = os.path.join(d, "model_float16")
    return model, hf_reference(model)


def load(d: str, name: str, weights: str, vram, **over):
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.session import Session
    with open(os.path.join(d, name, "plan.json")) as f:
        plan = Plan.from_json(f.read()).replace(gpu_experts=vram, expert_cache=False, **over)
    return Session.load(os.path.join(d, name), weights_dir=weights, plan=plan)


def against_transformers(s, ref, label: str) -> list[int]:
    import torch
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].numpy()
    ours = s.forward(PROMPT, all_logits=True)
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    moe = s.gpu.stage._moe
    print(f"\n{label}: {s.plan.describe()}, prefill logits max rel diff {rel:.2e}; greedy "
          f"{sum(a == b for a, b in zip(got, expected))}/{NEW_TOKENS} identical; hit rate {moe.hit_rate():.2f}, "
          f"{moe.crossings} block crossings")
    assert rel < 2e-2 and len(set(expected)) > 4, rel
    check_divergence(s, ref, got, expected)
    return got


@pytest.mark.parametrize("name", ["gpu_float16", "split_float16", "gpu_mxfp4"])
@pytest.mark.parametrize("vram", [HOST, MIXED, ALL_VRAM], ids=["host", "mixed", "vram"])
def test_greedy_matches_transformers(name, vram):
    """Experts on the host (the CPU's expert functions; quantized decode rows on the CPU's biased one-call sums), in
    VRAM (the GPU library's expert function per expert for fp16 experts; gpu_mxfp4's decode rows on the GPU's biased
    two-launch expert kernels), and a mix of both."""
    d = oss_dir(name)
    weights, ref = reference(d, name)
    served = vram if name != "split_float16" else ((),) + vram[1:]         # block 0 is the CPU stage's there
    s = load(d, name, weights, served)
    assert s.gpu is not None and s.gpu.stage is not None and s.gpu.stage._moe is not None
    moe = s.gpu.stage._moe
    against_transformers(s, ref, f"{name} {vram}")
    on_gpu_stage = [served[i] for i in s.plan.placement.gpu_layers]
    assert (moe.hit_rate() > 0) == any(on_gpu_stage)
    assert (moe.hit_rate() == 1.0) == all(len(v) == EXPERTS for v in on_gpu_stage)
    if name == "gpu_mxfp4" and moe.host._expert_sums:           # a CPU with the int8 one-call sums (AVX-512)
        # every decode row on MoeDecodeRow: host experts on the biased one-call sum (host halves where a block has
        # any), VRAM experts on the GPU's biased two-launch kernels (all-VRAM blocks routed on the GPU)
        row = moe.decode_row
        assert row is not None and sorted(moe.host._expert_sums) == [0] and sorted(row.gpu_sums) == [0]
        assert (row.host_halves > 0) == any(len(v) < EXPERTS for v in on_gpu_stage), row.host_halves
        assert (row.gpu_expert_rows > 0) == any(on_gpu_stage), row.gpu_expert_rows
        assert moe.expert_rows == moe.prefill_rows[0], "a decode row took the per-expert path"


def test_prompt_experts_stream_to_the_gpu_with_their_biases():
    """Plan.memory.expert_staging_bytes: a prompt's host experts run on the GPU's expert function, their weights
    streamed through two staging slots (fewer than a block's host experts the prompt selects, so slots are reused)
    and their biases copied to the device once at load (moe_prefill.ExpertPrefill); without staging the CPU computes
    them. The logits agree, and greedy decoding after the streamed prompt follows transformers."""
    from helmc.runtime.moe_prefill import device_bias_bytes, expert_slot_bytes
    d = oss_dir("gpu_mxfp4")
    weights, ref = reference(d, "gpu_mxfp4")
    s = load(d, "gpu_mxfp4", weights, MIXED)
    on_cpu = s.forward(PROMPT, all_logits=True)
    assert s.gpu.stage._moe.prefill.streamed_experts == 0
    staging = 2 * expert_slot_bytes(s.gpu.stage.bindings[0].post[-1], EXPERTS) + \
        device_bias_bytes(s.spec.moe, s.spec.hidden_size, s.spec.dtype_bytes, LAYERS)     # two slots, every bias
    s = load(d, "gpu_mxfp4", weights, MIXED, expert_staging_bytes=staging)
    streamed = s.forward(PROMPT, all_logits=True)
    prefill = s.gpu.stage._moe.prefill
    assert prefill.streamed_experts > 2 * 2, prefill.streamed_experts
    rel = float(np.abs(streamed - on_cpu).max() / np.abs(on_cpu).max())
    print(f"\nstreamed prompt experts: {prefill.streamed_experts}; logits max rel diff to the CPU's {rel:.2e}")
    assert rel < 1e-2
    # the GPU's fp16 GEMMs against the CPU's sums: a row's argmax may differ only where the CPU scores the two
    # tokens within twice the largest difference
    rows = np.arange(len(PROMPT))
    gap = on_cpu[rows, on_cpu.argmax(-1)] - on_cpu[rows, streamed.argmax(-1)]
    assert (gap <= 2 * np.abs(streamed - on_cpu).max()).all(), gap
    s.reset()
    against_transformers(s, ref, "gpu_mxfp4 streamed prompt experts")


def test_a_prompt_routed_on_the_gpu_is_the_prompt_routed_on_the_host():
    """A prompt's rows are routed on the GPU (topk_softmax in the routing kernel) where route() on the host routed
    them before: the same experts, so the logits differ only by the weights' last bits (expf against NumPy's exp)."""
    from helmc.runtime import moe_gpu
    from helmc.runtime.moe_decode_row import gpu_routes
    d = oss_dir("gpu_float16")
    s = load(d, "gpu_float16", os.path.join(d, "model_float16"), MIXED)
    assert gpu_routes(s.spec.moe)
    on_gpu = s.forward(PROMPT, all_logits=True)
    s.reset()
    moe_gpu.gpu_routes = lambda moe: False
    try:
        on_host = s.forward(PROMPT, all_logits=True)
    finally:
        moe_gpu.gpu_routes = gpu_routes
    np.testing.assert_allclose(on_gpu, on_host, rtol=0, atol=1e-3 * float(np.abs(on_host).max()))


@pytest.mark.parametrize("name", ["gpu_float16", "gpu_mxfp4"])
@pytest.mark.parametrize("vram", [HOST, MIXED], ids=["host", "mixed"])
def test_batched_decode_is_bitwise_single_runs(name, vram):
    """gpu_mxfp4: batched steps on MoeDecodeBatch, host experts on the CPU's biased m-row expert sums, VRAM ones on the
    GPU's biased m-row kernels, each row the bits of its one-row step; gpu_float16's VRAM experts on the per-expert
    path, row by row alike."""
    from tests.batch_decode_checks import batched_runs, prompts, single_runs
    d = oss_dir(name)
    weights = os.path.join(d, "model_float16") if name == "gpu_float16" else os.path.join(d, "gpt-oss-mxfp4.gguf")
    s = load(d, name, weights, vram)
    ps = prompts(s.spec.vocab_size, 6)
    singles = single_runs(s, ps, 8)
    batched, sizes = batched_runs(s, ps, 8, max_batch=4, stagger=1)
    assert {2, 3, 4} <= set(sizes), sizes
    for b, (one, many) in enumerate(zip(singles, batched)):
        assert np.array_equal(one, many), f"sequence {b}: a batched step differs from its single run"
    moe = s.gpu.stage._moe
    if name == "gpu_mxfp4" and moe.host._expert_rows:
        assert moe.decode_batch is not None and moe.decode_batch.steps > 0
        assert (moe.decode_batch.gpu_expert_rows > 0) == (vram == MIXED), moe.decode_batch.gpu_expert_rows
