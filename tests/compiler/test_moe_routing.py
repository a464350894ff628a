"""A mixture of experts' routing statistics measured by running the model (runtime/moe_routing.py): at build (a tiny
model is cheap to run) and by `helmc calibrate` on a tiny random Qwen3MoeForCausalLM bundle (8 experts, top-2, block 1 dense) counts each block's selections over the
calibration prompt, equal to the counts of transformers' own router outputs on the same token ids; it stores them in
the bundle as expert_stats.json, listed in the manifest (the bundle verifies after, and fails once the file is
edited), and replanning the bundle reads them. On a quantized bundle with the CPU's one-call expert sum (AVX-512) it
measures that kernel's read rate per selected-expert count into the calibrated profile, which the cost model then
prices a token's host experts at. The reference is recomputed from transformers on every run."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from helmc.errors import HelmcError

pytest.importorskip("tvm.relax")


def transformers_counts(ref, ids: list[int], num_experts: int) -> dict[int, list[int]]:
    """{block: selections per expert} from the routers' own top-k indices (forward hooks on each router)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    seen: dict[int, np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        for m in layer.modules():
            if isinstance(m, Qwen3MoeTopKRouter):
                hooks.append(m.register_forward_hook(
                    lambda mod, args, out, _i=i: seen.__setitem__(_i, out[2].reshape(-1).numpy())))
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return {i: np.bincount(idx, minlength=num_experts).tolist() for i, idx in seen.items()}


def test_calibrate_counts_the_routing_transformers_computes(tiny, tmp_path, cache_dir):
    from tokenizers import Tokenizer

    from helmc import api
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.bundle.expert_stats import EXPERT_STATS_FILE, read_expert_stats
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.runtime.moe_routing import CALIBRATION_NAME, CALIBRATION_TEXT
    d, ref = tiny.model("qwen3_moe", num_layers=3)
    hw = dataclasses.replace(tiny.hardware, gpu=None, link=None)
    bundle = str(tmp_path / "moe.bundle")
    r = api.build(d, hw, bundle, cache_dir=cache_dir, quiet=True)
    hw_path = str(tmp_path / "hardware.json")
    hw.save(hw_path)
    ids = Tokenizer.from_file(os.path.join(bundle, "tokenizer.json")).encode(CALIBRATION_TEXT).ids
    ids = ids[:min(512, r.plan.memory.max_context)]
    expected = transformers_counts(ref, ids, 8)
    assert sorted(expected) == [0, 2]

    at_build = read_expert_stats(bundle, verify_bundle(bundle))       # a tiny model: counted at build already
    assert at_build.source == "build" and [list(at_build.counts[i]) for i in (0, 2)] == [expected[0], expected[2]]
    from helmc.runtime.bundle.plan import Plan
    with open(os.path.join(bundle, "plan.json")) as f:
        assert Plan.from_json(f.read()) == r.plan                       # the plan made again is the one stored

    result = api.calibrate(bundle, hw_path, steps=3)
    assert len(result.routing) == 2 and f"wrote {os.path.join(bundle, EXPERT_STATS_FILE)}" in result.routing[0]
    assert result.routing[1].startswith("plan made again from them: ")    # and stored: the calibrated profile's plan
    with open(os.path.join(bundle, "plan.json")) as f:
        assert Plan.from_json(f.read()) == replan_bundle(bundle, result.profile)[0]
    assert result.routing[0] in result.summary() and json.loads(json.dumps(result.to_json_dict()))["routing"]
    assert result.profile.cpu.expert_sum_reads == ()                   # float experts: no one-call expert sum
    manifest = verify_bundle(bundle)                   # listed with its digest: the bundle verifies as a whole
    stats = read_expert_stats(bundle, manifest)
    assert stats.source == "calibrate" and stats.prompt == CALIBRATION_NAME

    assert stats.counts[1] == ()                                            # block 1 is dense
    assert stats.tokens == len(ids) > 100
    for i in (0, 2):
        assert list(stats.counts[i]) == expected[i], f"block {i}"
        assert len({c for c in expected[i]}) > 1                          # not a uniform count the test would miss
    # the first half of the prompt counted alone (causal: its routing is that of the half prompt on its own)
    first = transformers_counts(ref, ids[:len(ids) // 2], 8)
    assert stats.first_half_tokens == len(ids) // 2
    assert [list(stats.first_half[i]) for i in (0, 2)] == [first[0], first[2]] != [expected[0], expected[2]]

    p, _ = replan_bundle(bundle, hw_path)                                   # reads and checks the stored statistics
    assert p.provenance.architecture_hash == r.spec.architecture_hash()

    with open(os.path.join(bundle, EXPERT_STATS_FILE), "a") as f:           # edited after: the manifest catches it
        f.write(" ")
    with pytest.raises(HelmcError, match=f"bundle: {EXPERT_STATS_FILE} size expected"):
        verify_bundle(bundle)


def test_calibrate_measures_the_one_call_expert_sum_the_cost_model_prices(tmp_path, host_hardware, cache_dir):
    from helmc import api
    from helmc.planner.moe import EXPERT_SUM_UNMEASURED, expert_bytes_by_type, expert_step_ms
    from helmc.planner.search_partition import plan
    from helmc.schedules.cpu.isa import select_isa
    from helmc.testing import make_tiny_model
    if select_isa(host_hardware.cpu.features).tier != "avx512":
        pytest.skip("the one-call expert sum is built for AVX-512 only")
    d = str(tmp_path / "model")        # whole K-quant blocks: hidden and expert width 256
    make_tiny_model(d, "qwen3_moe", dtype="float16", num_layers=3, head_dim=64, hidden_size=256,
                    moe_intermediate_size=256)
    hw = dataclasses.replace(host_hardware, gpu=None, link=None)
    # built for batches of 4 as test_moe_gguf builds the same model, so the artifact cache compiles it once for both
    # modules (~80 s on 2 cores); calibrate times the one-row expert sum on one row, which a batched build has too
    r = api.build(d, hw, d + ".bundle", cache_dir=cache_dir, quiet=True, quant="q4_k_m", batch=4)
    hw_path = str(tmp_path / "hardware.json")
    hw.save(hw_path)
    cal = api.calibrate(r.bundle_dir, hw_path, steps=3).profile
    reads = {(x.weight_type, x.experts): x.gbs for x in cal.cpu.expert_sum_reads}
    assert sorted(reads) == [("q4_k", 1), ("q4_k", 2)] and all(g > 0 for g in reads.values())   # top-2, q4_k gate/up
    assert cal.cpu.expert_sum_gbs("q4_k", 1.5) == pytest.approx((reads["q4_k", 1] + reads["q4_k", 2]) / 2)
    assert EXPERT_SUM_UNMEASURED in plan(r.spec, hw).predictions.fallbacks
    assert EXPERT_SUM_UNMEASURED not in plan(r.spec, cal).predictions.fallbacks
    # every expert on the host: a token reads top_k / E of each block's experts at the rate of 2 experts a call
    ms, _ = expert_step_ms(r.spec, cal, 1, 0)
    bytes_per_token = sum(sum(expert_bytes_by_type(r.spec, i).values()) for i in range(3)) * 2 / 8
    assert ms == pytest.approx(1e3 * bytes_per_token / (reads["q4_k", 2] * 1e9), rel=1e-9)
    from helmc.hardware.profile import HardwareProfile
    assert HardwareProfile.from_json(cal.to_json()) == cal and '"expert_sum_reads"' not in hw.to_json()
