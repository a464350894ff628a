"""Mixture of experts on the GPU stage (attention, norms, router and head on the GPU, the routed experts on the CPU)
against Hugging Face transformers, on a tiny random Qwen3MoeForCausalLM (8 experts, top-2, normalised top-k, block 1
dense).

The bundles are built on the compiler machine by
    python -m tests.device.build_moe_gpu_bundles .devrt/moe_gpu
and carried to the GPU machine; the tests look in $HELMC_MOE_GPU_DIR (default .devrt/moe_gpu). They import no
compiler: they run with the runtime-only TVM. Pass: 16 greedy tokens identical to transformers in fp32 over the
same weights (the GPU stage's activations are fp16, so at the first divergence, if any, each side's token must be
in the other's top 5: the dense GPU tests' rule) and prefill logits within 2e-2 relative; a batched decode step of
several sequences bit-identical per sequence to their single runs on the same bundle; on the q4_k_m bundle with
variants for 8 sequences, steps of 2 to 8 rows through the m-row expert sums (runtime/moe_decode_batch.py) with
experts on the host, in VRAM and both, bit-identical per sequence too.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu_prebuilt import prebuilt_dir

pytestmark = pytest.mark.gpu

PROMPT = [1, 17, 250, 33, 100, 7, 2, 480, 64]
NEW_TOKENS = 16


def moe_dir(bundle: str = "gpu_float16") -> str:
    """The bundles' folder, once it holds `bundle` and a CUDA device is here; else the test skips."""
    return prebuilt_dir("HELMC_MOE_GPU_DIR", "moe_gpu", os.path.join(bundle, "manifest.json"),
                        f"MoE GPU bundle {bundle}", "build_moe_gpu_bundles .devrt/moe_gpu")


def reference(d: str, name: str):
    """(weights for the bundle, transformers in fp32 over the same weights)."""
    import torch
    from transformers import AutoModelForCausalLM
    if name == "gpu_q4_k_m":
        pytest.importorskip("gguf")         # the reference dequantizes with llama.cpp's own gguf package
        from helmc.testing import hf_on_dequantized_weights
        path = os.path.join(d, "model_float16-q4_k_m.gguf")
        return path, hf_on_dequantized_weights(os.path.join(d, "model_float16"), path)
    model = os.path.join(d, "model_bfloat16" if "bfloat16" in name else "model_float16")
    return model, AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_greedy(model, ids, n):
    import torch
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def check_divergence(session, ref, got: list[int], expected: list[int]) -> None:
    """Where helmc's greedy tokens part from transformers', each side's token is in the other's top 5 there."""
    import torch
    if got == expected:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
    with torch.no_grad():
        their_top5 = np.argsort(-ref(torch.tensor([PROMPT + expected[:i]])).logits[0, -1].numpy())[:5]
    session.reset()
    our_top5 = np.argsort(-session.forward(PROMPT + expected[:i])[-1])[:5]
    assert got[i] in their_top5 and expected[i] in our_top5, (i, got, expected)


@pytest.mark.parametrize("name", ["gpu_float16", "split_float16", "gpu_bfloat16", "gpu_q4_k_m"])
def test_greedy_matches_transformers(name):
    import torch

    from helmc.runtime.session import Session
    d = moe_dir()
    weights, ref = reference(d, name)
    s = Session.load(os.path.join(d, name), weights_dir=weights)
    assert s.gpu is not None and s.gpu.stage is not None and s.gpu.stage._moe is not None
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].numpy()
    ours = s.forward(PROMPT, all_logits=True)
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    same = sum(a == b for a, b in zip(got, expected))
    print(f"\n{name}: {s.plan.describe()}, prefill logits max rel diff {rel:.2e}; greedy {same}/{NEW_TOKENS} identical; "
          f"{s.gpu.stage._moe.crossings} block crossings")
    assert rel < 2e-2 and len(set(expected)) > 4
    check_divergence(s, ref, got, expected)


def test_batched_decode_is_bitwise_single_runs():
    from helmc.runtime.session import Session
    from tests.batch_decode_checks import batched_runs, prompts, single_runs
    d = moe_dir()
    s = Session.load(os.path.join(d, "gpu_float16"), weights_dir=os.path.join(d, "model_float16"))
    ps = prompts(s.spec.vocab_size, 6)
    singles = single_runs(s, ps, 8)
    batched, sizes = batched_runs(s, ps, 8, max_batch=4, stagger=1)
    assert {2, 3, 4} <= set(sizes), sizes
    for b, (one, many) in enumerate(zip(singles, batched)):
        assert np.array_equal(one, many), f"sequence {b}: a batched step differs from its single run"


@pytest.mark.parametrize("name", ["gpu_float16", "gpu_q4_k_m"])
@pytest.mark.parametrize("vram", [((0, 3, 5), (), (1, 2, 6, 7)), (tuple(range(8)), (), tuple(range(8)))])
def test_experts_in_vram_run_on_the_gpu_beside_the_cpu(vram, name):
    """Plan.placement.gpu_experts: those experts' weights bound in VRAM and computed by the GPU while the CPU computes the
    block's others (block 1 is dense: no experts). Greedy against transformers by the rule above; the share of
    selected experts served from VRAM is what the placement gives (all of them when every expert is there).
    Quantized experts decode through the GPU's two expert kernels over the stacked VRAM experts (routed on the GPU
    when every expert is there) and the CPU's one-call expert sum."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.session import Session
    d = moe_dir()
    weights, ref = reference(d, name)
    base = Plan.from_json(open(os.path.join(d, name, "plan.json")).read())
    s = Session.load(os.path.join(d, name), weights_dir=weights, plan=base.replace(gpu_experts=vram))
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    moe = s.gpu.stage._moe
    if name == "gpu_q4_k_m":
        assert sorted(moe.decode_row.gpu_sums) == [0, 1] and sorted(moe.host._expert_sums) == [0, 1]
    print(f"\ngpu_experts {vram}: hit rate {moe.hit_rate():.2f}; greedy {sum(a == b for a, b in zip(got, expected))}"
          f"/{NEW_TOKENS} identical")
    assert 0 < moe.hit_rate() <= 1 and (moe.hit_rate() == 1.0) == (len(vram[0]) == 8)
    check_divergence(s, ref, got, expected)


@pytest.mark.parametrize("vram", [((0, 3, 5), (), (1, 2, 6, 7)), (tuple(range(8)), (), tuple(range(8))), ((), (), ())])
def test_decode_graphs_replay_the_eager_tokens(vram):
    """Quantized experts decode one row through MoeDecodeRow, replayed as CUDA graphs between the host's halves
    (moe_decode_graph.MoeDecodeGraph): the tokens are those of the same steps run eagerly (graphs off), bit for bit,
    and the steps after the first two replay: one graph per segment (a segment per block waiting on the host; one
    for the whole step when every expert is in VRAM)."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.moe_decode_graph import MoeDecodeGraph
    from helmc.runtime.session import Session
    d = moe_dir()
    weights, _ = reference(d, "gpu_q4_k_m")
    plan = Plan.from_json(open(os.path.join(d, "gpu_q4_k_m", "plan.json")).read()).replace(gpu_experts=vram)
    runs = {}
    for graphs in (True, False):
        s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights, plan=plan, cuda_graph=graphs)
        runs[graphs] = (s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens,
                        s.gpu.decode_graph, s.gpu.stage._moe.hit_rate())
    graph = runs[True][1]
    assert isinstance(graph, MoeDecodeGraph) and runs[False][1] is None
    every_block_in_vram = len(vram[0]) == 8
    print(f"\ngpu_experts {vram}: {len(graph.segments)} segments, replays {graph.replays}, captures "
          f"{graph.captures}, eager {graph.eager_steps}, disabled {graph.disabled!r}")
    assert graph.disabled == "" and graph.captures >= 1 and graph.replays >= NEW_TOKENS // 2, graph.replays
    assert len(graph.segments) == (1 if every_block_in_vram else 3)        # blocks 0 and 2 wait on the host
    assert runs[True][0] == runs[False][0]
    assert runs[True][2] == runs[False][2] and (runs[True][2] == 1.0) == every_block_in_vram


def test_prompt_experts_stream_to_the_gpu():
    """Plan.memory.expert_staging_bytes: a prompt's host experts run on the GPU, their weights streamed through a ring of
    staging slots (runtime/moe_prefill.py; two slots here, fewer than the host experts the prompt selects in a block,
    so slots are reused after their readers). Without staging the CPU computes them. The prompt's logits agree, and
    greedy decoding after the streamed prompt follows transformers by the rule above."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.moe_prefill import expert_slot_bytes
    from helmc.runtime.session import Session
    d = moe_dir()
    weights, ref = reference(d, "gpu_q4_k_m")
    base = Plan.from_json(open(os.path.join(d, "gpu_q4_k_m", "plan.json")).read()).replace(gpu_experts=((0, 3), (), (5,)))
    logits, streamed, staging = {}, {}, 0
    for streams in (False, True):
        s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights,
                         plan=base.replace(expert_staging_bytes=staging))
        logits[streams] = s.forward(PROMPT, all_logits=True)
        streamed[streams] = s.gpu.stage._moe.prefill.streamed_experts
        experts = s.gpu.stage.bindings[0].post[-1]
        staging = 2 * expert_slot_bytes(experts, 8)           # two experts' slots
    assert streamed[False] == 0 and streamed[True] > 2 * 2, streamed
    a, b = logits[False], logits[True]
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    print(f"\nstreamed prompt experts: {streamed[True]}; logits max rel diff to the CPU's {rel:.2e}")
    assert rel < 1e-2 and np.array_equal(a.argmax(-1), b.argmax(-1))
    s.reset()
    got = s.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False).tokens
    check_divergence(s, ref, got, hf_greedy(ref, PROMPT, NEW_TOKENS))


@pytest.mark.parametrize("vram", [((0, 3), (), (5,)), ((), (), ()), (tuple(range(8)), (), tuple(range(8)))])
def test_grouped_expert_prefill_is_the_per_expert_loop_bit_for_bit(vram):
    """ExpertPrefill.add_experts (one gather of every (row, expert) pair, each expert over its slice, host experts
    streamed through two staging slots, one combine kernel) equals the per-expert loop it replaced, every bit:
    h[rows_e] += w * expert(m[rows_e]) for each expert ascending, weights uploaded for the loop."""
    d = moe_dir()
    import cupy as cp

    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_stream, tvm_to_cupy
    from helmc.runtime.moe_experts import route
    from helmc.runtime.moe_prefill import expert_slot_bytes
    from helmc.runtime.session import Session
    weights, _ = reference(d, "gpu_q4_k_m")
    plan = Plan.from_json(open(os.path.join(d, "gpu_q4_k_m", "plan.json")).read()).replace(gpu_experts=vram)
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights, plan=plan)
    experts = s.gpu.stage.bindings[0].post[-1]
    staging = 2 * expert_slot_bytes(experts, 8)
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights,
                     plan=plan.replace(expert_staging_bytes=staging))
    prefill, experts = s.gpu.stage._moe.prefill, s.gpu.stage.bindings[0].post[-1]
    assert prefill.applies(experts)
    rng = np.random.default_rng(0)
    S, H = 300, s.spec.hidden_size
    idx, w = route(rng.standard_normal((S, 8)).astype(np.float32), s.spec.moe)
    m = cp.asarray(rng.standard_normal((S, H)).astype(np.float16))
    h = cp.asarray(rng.standard_normal((S, H)).astype(np.float32))
    fn = prefill.expert_fns[experts.signature]
    with s.gpu.stream, tvm_stream(s.gpu.stream):
        got = h.copy()
        prefill.add_experts(m, idx, w, experts, got)
        want = h.copy()
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            wts = experts.experts[e] if int(e) in experts.on_gpu else \
                tuple(cupy_to_tvm(cp.asarray(np.from_dlpack(t))) for t in experts.experts[e])
            r = cp.asarray(rows)
            y = tvm_to_cupy(fn(cupy_to_tvm(cp.ascontiguousarray(m[r])), *wts))
            want[r] += cp.asarray(w[rows, slot, None]) * y.astype(cp.float32)
        s.gpu.stream.synchronize()
    host = len(set(idx.ravel().tolist()) - set(experts.on_gpu))
    assert prefill.streamed_experts == host
    assert float(cp.abs(got - h).max()) > 0 and cp.array_equal(got, want)


def test_host_experts_are_locked_once_at_load():
    """The host experts a prompt streams are page-locked when the model is loaded (cudaHostRegister of the whole
    host share takes ~1 s at Qwen3-30B-A3B's size): prompts lock nothing more, and loading without staging locks
    nothing."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.moe_prefill import expert_slot_bytes
    from helmc.runtime.session import Session
    d = moe_dir()
    weights, _ = reference(d, "gpu_q4_k_m")
    plan = Plan.from_json(open(os.path.join(d, "gpu_q4_k_m", "plan.json")).read())
    plan = plan.replace(gpu_experts=((0, 3), (), (5,)))
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights, plan=plan.replace(expert_staging_bytes=0))
    assert s.gpu.stage._moe.prefill.lock_calls == 0
    experts = s.gpu.stage.bindings[0].post[-1]
    staging = 2 * expert_slot_bytes(experts, 8)
    del s
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights,
                     plan=plan.replace(expert_staging_bytes=staging))
    prefill = s.gpu.stage._moe.prefill
    at_load = prefill.lock_calls
    # blocks 0 and 2 route; their host experts are runs [1, 3), [4, 8) and [0, 5), [6, 8) of the three kinds
    assert at_load == 3 * (2 + 2), at_load
    for _ in range(2):
        s.reset()
        s.forward(PROMPT + PROMPT, all_logits=False)
    assert prefill.streamed_experts > 0 and prefill.lock_calls == at_load


@pytest.mark.parametrize("vram", [((0, 3, 5), (), (1, 2, 6, 7)), (tuple(range(8)), (), tuple(range(8))), ((), (), ())])
def test_batched_quantized_steps_of_2_to_8_rows_are_bitwise_single_runs(vram):
    """A served step of B = 2..8 sequences runs each block's experts of every row in the m-row calls (the GPU's two
    launches over every (row, expert) pair in VRAM, the CPU's m-row expert sum over the host ones, one combine):
    every sequence's logits equal its single run's (the one-row path, CUDA graphs on), every bit."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.session import Session
    from tests.batch_decode_checks import batched_runs, compare, prompts, single_runs
    d = moe_dir("gpu_q4_k_m_b8")
    path = os.path.join(d, "gpu_q4_k_m_b8")
    # the slots kept: the VRAM expert cache would move experts between the single runs and the batched ones
    plan = Plan.from_json(open(os.path.join(path, "plan.json")).read()).replace(gpu_experts=vram, expert_cache=False)
    s = Session.load(path, weights_dir=os.path.join(d, "model_float16-q4_k_m.gguf"), plan=plan)
    moe = s.gpu_moe()
    assert moe.decode_batch is not None and sorted(moe.decode_batch.cpu_rows) == [0, 1]
    assert sorted(moe.decode_batch.gpu_rows) == [0, 1]
    ps = prompts(s.spec.vocab_size, 8)
    singles = single_runs(s, ps, 10)
    batched, sizes = batched_runs(s, ps, 10, max_batch=8, stagger=1)
    print(f"\ngpu_experts {vram}: batch sizes {sorted(set(sizes))}, {moe.decode_batch.steps} batched block steps, "
          f"hit rate {moe.hit_rate():.2f}")
    assert set(range(2, 9)) <= set(sizes), sizes
    assert moe.decode_batch.steps >= 2 * len([n for n in sizes if n > 1])      # blocks 0 and 2 of every step
    compare(singles, batched, f"qwen3_moe q4_k_m gpu_experts {vram}")


def test_the_vram_expert_cache_fills_its_slots_from_served_batches():
    """A served plan runs the VRAM expert cache too: batched steps feed it their rows' selections and it promotes the
    hottest host experts into the slots (copies never waited on), so more of the batch's selections are served from
    VRAM than with the plan's slots kept; every sequence's greedy tokens are those of its run with the slots kept, or part
    from them only at a near tie."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.session import Session
    from tests.batch_decode_checks import batched_runs, prompts
    d = moe_dir("gpu_q4_k_m_b8")
    path = os.path.join(d, "gpu_q4_k_m_b8")
    weights = os.path.join(d, "model_float16-q4_k_m.gguf")
    base = Plan.from_json(open(os.path.join(path, "plan.json")).read()).replace(gpu_experts=((0, 3), (), (1, 2)))
    runs = {}
    for cache in (False, True):
        s = Session.load(path, weights_dir=weights, plan=base.replace(expert_cache=cache))
        moe = s.gpu_moe()
        ps = prompts(s.spec.vocab_size, 8)
        before = moe.served(decode=True)
        logits, sizes = batched_runs(s, ps, 24, max_batch=8, stagger=1)
        rows, hits = (a - b for a, b in zip(moe.served(decode=True), before))
        runs[cache] = (logits, hits / rows, moe.cache_promotions())
        assert max(sizes) == 8, sizes
        del s, moe
    (kept, kept_rate, none), (cached, cached_rate, promoted) = runs[False], runs[True]
    print(f"\nbatched decode hit rate: slots kept {kept_rate:.3f}, cache on {cached_rate:.3f} ({promoted} promotions)")
    assert none == 0 and promoted > 0 and cached_rate > kept_rate
    for b, (want, got) in enumerate(zip(kept, cached)):
        # an expert moved from the CPU's int8 sum to the GPU's fp16 one changes a row by ~1e-2, and a router's near tie
        # downstream can turn that into other experts: where the greedy tokens first part, each is in the other's top 5
        parted = np.flatnonzero(got.argmax(1) != want.argmax(1))
        if parted.size:
            i = int(parted[0])
            assert want[i].argmax() in np.argsort(-got[i])[:5] and got[i].argmax() in np.argsort(-want[i])[:5], (b, i)
    print(f"greedy tokens equal in {sum(np.array_equal(a.argmax(1), c.argmax(1)) for a, c in zip(kept, cached))} of "
          f"{len(kept)} sequences")


def test_served_moe_rows_show_in_the_server_metrics():
    """`helmc serve`'s /metrics count a mixture of experts' decode selections and those VRAM served
    (runtime/serve/metrics.py, what bench_moe_serve reports as moe_decode_hit_rate): after batched requests the gauges
    equal the GPU stage's own counts since the engine was watched (the warm-up's rows left out), hits between none
    and all with experts split between VRAM and the host."""
    from benchmarks.bench_serve import run_requests
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.serve.load import load_engine
    from helmc.runtime.serve.metrics import Metrics
    d = moe_dir("gpu_q4_k_m_b8")
    path = os.path.join(d, "gpu_q4_k_m_b8")
    plan = Plan.from_json(open(os.path.join(path, "plan.json")).read()).replace(
        gpu_experts=((0, 3, 5), (), (1, 2, 6, 7)), expert_cache=False)   # some selections on each side
    engine, _ = load_engine(path, 4, weights_dir=os.path.join(d, "model_float16-q4_k_m.gguf"), quiet=True, plan=plan)
    metrics = Metrics()
    metrics.watch(engine)
    moe = engine.model.session.gpu.stage._moe
    base = moe.served(decode=True)
    run_requests(engine, [PROMPT, PROMPT[::-1], PROMPT[2:], PROMPT[:5]], 8, "metrics")
    rows, hits = moe.served(decode=True)
    got = {name: float(value) for name, _, value in (line.partition(" ") for line in
                                                     metrics.text()[0].decode().splitlines())
           if name.startswith("helmc_moe_")}
    assert got == {"helmc_moe_decode_expert_selections": rows - base[0],
                   "helmc_moe_decode_vram_hits": hits - base[1]}, got
    assert 0 < got["helmc_moe_decode_vram_hits"] < got["helmc_moe_decode_expert_selections"]


def test_the_host_half_of_a_routed_decode_block_is_measured():
    """helmc calibrate's measure of the GPU's wait at a routed decode block with experts on the host
    (moe_expert_rate.measure_host_half): one host half a waiting block per decode step, each a positive time under a
    millisecond (route, slots, launches; the CPU's sum apart); None where every expert is in VRAM (routed on the GPU)."""
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.moe_expert_rate import measure_host_half
    from helmc.runtime.session import Session
    d = moe_dir()
    weights, _ = reference(d, "gpu_q4_k_m")
    base = Plan.from_json(open(os.path.join(d, "gpu_q4_k_m", "plan.json")).read())
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights,
                     plan=base.replace(gpu_experts=((0, 3, 5), (), (1, 2, 6, 7)), expert_cache=False))
    row = s.gpu_moe().decode_row
    ms = measure_host_half(s, tokens=8)
    print(f"\nhost half {ms:.4f} ms a block, {row.host_halves} halves")
    assert 0 < ms < 1 and row.host_halves >= 2 * 2 * 7 and row.host_halves % 2 == 0   # 2 waiting blocks a step
    whole = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights,
                         plan=base.replace(gpu_experts=(tuple(range(8)), (), tuple(range(8)))))
    assert measure_host_half(whole, tokens=4) is None
