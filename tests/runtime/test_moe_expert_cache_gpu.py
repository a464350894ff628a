"""The VRAM expert cache on the GPU (runtime/moe_expert_cache.py, Plan.placement.expert_cache) on the tiny random
Qwen3MoeForCausalLM of tests/runtime/test_moe_gpu.py (8 experts, top-2; blocks 0 and 2 routed), q4_k_m bundle.

Each routed block starts with two VRAM slots holding the two experts a first run selected least, so the cache has
something to do: decoding 64 tokens, the experts the prompt's continuation keeps selecting are promoted into the
slots (copied on a copy stream, served once the copy is done). Pass: the share of selected experts served from VRAM
rises above the same placement's without the cache; greedy tokens equal the run without the cache or, where they
part, follow transformers by the MoE GPU tests' rule (the GPU's fp16 expert sum and the CPU's fp32 one round
differently); the run with CUDA graphs equals the one without, token for token, hit for hit (slot addresses never
change: no re-capture); a prompt after the promotions (prefill reads the same residency) gives the logits of the
cache-off session. Bundles: `python -m tests.device.build_moe_gpu_bundles .devrt/moe_gpu --only gpu_q4_k_m
gpu_q4_k_m_b8`, carried as .devrt/moe_gpu.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.runtime.test_moe_gpu import PROMPT, check_divergence, hf_greedy, moe_dir, reference

pytestmark = pytest.mark.gpu

TOKENS = 64
ROUTED = (0, 2)                  # block 1 is dense


def _plan(d: str, bundle: str, vram, cache: bool):
    from helmc.runtime.bundle.plan import Plan
    with open(os.path.join(d, bundle, "plan.json")) as f:
        return Plan.from_json(f.read()).replace(gpu_experts=vram, expert_cache=cache)


def _run(d: str, weights: str, vram, cache: bool, graphs: bool = True, prompt=PROMPT):
    from helmc.runtime.session import Session
    s = Session.load(os.path.join(d, "gpu_q4_k_m"), weights_dir=weights, plan=_plan(d, "gpu_q4_k_m", vram, cache),
                     cuda_graph=graphs)
    r = s.generate(prompt_ids=prompt, max_new_tokens=TOKENS, stop_at_eos=False)
    return s, r


def _residencies(s) -> dict:
    return {i: s.gpu.stage.bindings[i].post[-1].residency for i in ROUTED}


@pytest.fixture(scope="module")
def cold_slots():
    """(d, weights, per block the two experts a cache-on run selected least: the slots the tests start from,
    transformers over the same weights)."""
    d = moe_dir("gpu_q4_k_m")
    weights, ref = reference(d, "gpu_q4_k_m")
    s, _ = _run(d, weights, ((0, 1), (), (0, 1)), cache=True)
    picked = {}
    for i, res in _residencies(s).items():
        assert res is not None and res.selections == (TOKENS - 1) * 2      # every decode token, top-2 (not prefill)
        picked[i] = tuple(sorted(np.argsort(res.selected, kind="stable")[:2].tolist()))
    del s
    return d, weights, (picked[0], (), picked[2]), ref


def test_the_cache_promotes_the_selected_experts(cold_slots):
    d, weights, vram, ref = cold_slots
    off_s, off = _run(d, weights, vram, cache=False)
    assert all(r is None for r in _residencies(off_s).values())
    on_s, on = _run(d, weights, vram, cache=True)
    res = _residencies(on_s)
    print(f"\ncold slots {vram}: hit rate without the cache {off.experts['expert_cache_hit_rate']:.3f}, with "
          f"{on.experts['expert_cache_hit_rate']:.3f}; promotions {on.experts['expert_cache_promotions']}; slots now "
          f"{ {i: r.slot_expert.tolist() for i, r in res.items()} }; tokens equal {off.tokens == on.tokens}")
    assert off.experts["expert_cache"] is False and on.experts["expert_cache"] is True
    assert off.experts["expert_cache_promotions"] == 0 and on.experts["expert_cache_promotions"] >= 1
    assert on.experts["expert_cache_hit_rate"] > off.experts["expert_cache_hit_rate"]
    for i, r in res.items():
        r.check()
        moved = set(r.slot_expert.tolist()) - set(vram[i])
        margin = r.options.margin          # a promoted expert's decayed count beat a slot's by more than this
        assert all(r.selected[e] > margin for e in moved), (i, moved, r.selected.tolist())
    assert on_s.gpu.decode_graph.replays >= TOKENS // 2 and on_s.gpu.decode_graph.disabled == ""
    if on.tokens != off.tokens:
        check_divergence(on_s, ref, on.tokens, hf_greedy(ref, PROMPT, TOKENS))


def test_graphs_replay_the_eager_tokens_with_the_cache(cold_slots):
    d, weights, vram, _ = cold_slots
    runs = {}
    for graphs in (True, False):
        s, r = _run(d, weights, vram, cache=True, graphs=graphs)
        runs[graphs] = (r.tokens, r.experts["expert_cache_hit_rate"], r.experts["expert_cache_promotions"],
                        {i: x.slot_expert.tolist() for i, x in _residencies(s).items()})
        del s
    print(f"\nwith graphs {runs[True][1:]}, without {runs[False][1:]}")
    assert runs[True][2] >= 1
    assert runs[True] == runs[False]


def test_a_prompt_after_promotions_reads_the_moved_experts(cold_slots):
    """Prefill asks the same residency: experts promoted during decode run from their new slots (and the ones
    they replaced from the host's rows), and the prompt's logits are the cache-off session's."""
    d, weights, vram, _ = cold_slots
    logits = {}
    for cache in (False, True):
        s, r = _run(d, weights, vram, cache=cache)
        assert (r.experts["expert_cache_promotions"] >= 1) == cache
        s.reset()
        logits[cache] = s.forward(PROMPT, all_logits=True)
        del s
    a, b = logits[False], logits[True]
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    print(f"\nprompt logits after promotions: max rel diff to the cache-off session {rel:.2e}")
    assert rel < 1e-2 and np.array_equal(a.argmax(-1), b.argmax(-1))


def test_batched_steps_share_the_residency():
    """A served step of several sequences counts into and reads the same residency as the one-row path (one
    ExpertResidency per block: the BlockRow's slot_of is its array), the cache promotes during batched decode, and
    every sequence's logits follow its single run without the cache: within 5e-2 relative up to the first step
    where their greedy tokens part (the GPU's and the CPU's expert sums round differently)."""
    from helmc.runtime.session import Session
    from tests.batch_decode_checks import batched_runs, prompts, single_runs
    d = moe_dir("gpu_q4_k_m_b8")
    path = os.path.join(d, "gpu_q4_k_m_b8")
    weights = os.path.join(d, "model_float16-q4_k_m.gguf")
    vram = ((0, 1), (), (0, 1))
    off = Session.load(path, weights_dir=weights, plan=_plan(d, "gpu_q4_k_m_b8", vram, False))
    ps = prompts(off.spec.vocab_size, 8)
    singles = single_runs(off, ps, 24)
    del off
    s = Session.load(path, weights_dir=weights, plan=_plan(d, "gpu_q4_k_m_b8", vram, True))
    moe = s.gpu.stage._moe
    batched, sizes = batched_runs(s, ps, 24, max_batch=8, stagger=1)
    res = _residencies(s)
    rows = {i: moe.decode_row.block(s.gpu.stage.bindings[i].post[-1]) for i in ROUTED}
    agree = []
    for want, got in zip(singles, batched):
        parted = np.flatnonzero(want.argmax(1) != got.argmax(1))
        n = int(parted[0]) + 1 if parted.size else len(want)       # up to and with the first differing step
        agree.append(n)
        rel = float(np.abs(got[:n] - want[:n]).max() / np.abs(want[:n]).max())
        assert rel < 5e-2, (rel, n)
    print(f"\nbatched with the cache: sizes {sorted(set(sizes))}, promotions {moe.cache_promotions()}, hit rate "
          f"{moe.hit_rate():.3f}, slots {[r.slot_expert.tolist() for r in res.values()]}, steps agreeing {agree}")
    for i in ROUTED:
        assert rows[i].cache.residency is res[i] and rows[i].slot_of is res[i].slot_of
        res[i].check()
    assert moe.decode_batch.steps > 0 and moe.cache_promotions() >= 1
