"""A mixture of experts' routing statistics measured by running the model (runtime/moe_routing.py): `helmc calibrate`
on a tiny random Qwen3MoeForCausalLM bundle (8 experts, top-2, block 1 dense) counts each block's selections over the
calibration prompt, equal to the counts of transformers' own router outputs on the same token ids; it stores them in
the bundle as expert_stats.json, listed in the manifest (the bundle verifies after, and fails once the file is
edited), and replanning the bundle reads them. The reference is recomputed from transformers on every run."""
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

    result = api.calibrate(bundle, hw_path, steps=3)
    assert len(result.routing) == 1 and f"wrote {os.path.join(bundle, EXPERT_STATS_FILE)}" in result.routing[0]
    assert result.routing[0] in result.summary() and json.loads(json.dumps(result.to_json_dict()))["routing"]
    manifest = verify_bundle(bundle)                   # listed with its digest: the bundle verifies as a whole
    stats = read_expert_stats(bundle, manifest)
    assert stats.source == "calibrate" and stats.prompt == CALIBRATION_NAME

    ids = Tokenizer.from_file(os.path.join(bundle, "tokenizer.json")).encode(CALIBRATION_TEXT).ids
    ids = ids[:min(512, r.plan.max_context)]
    expected = transformers_counts(ref, ids, 8)
    assert sorted(expected) == [0, 2] and stats.counts[1] == ()            # block 1 is dense
    assert stats.tokens == len(ids) > 100
    for i in (0, 2):
        assert list(stats.counts[i]) == expected[i], f"block {i}"
        assert len({c for c in expected[i]}) > 1                          # not a uniform count the test would miss

    p, _ = replan_bundle(bundle, hw_path)                                   # reads and checks the stored statistics
    assert p.architecture_hash == r.spec.architecture_hash()

    with open(os.path.join(bundle, EXPERT_STATS_FILE), "a") as f:           # edited after: the manifest catches it
        f.write(" ")
    with pytest.raises(HelmcError, match=f"bundle: {EXPERT_STATS_FILE} size expected"):
        verify_bundle(bundle)
