"""A tiny Qwen3 with YaRN RoPE (config.json's rope_parameters, the long-context recipe; its ramp and attention factor
change every frequency and scale q.k) built on the CPU: prefill logits within the dense tests' 1e-4 of transformers'
fp32 and 24 greedy tokens identical, positions past the original context included."""
from __future__ import annotations

import dataclasses

import numpy as np

from test_end_to_end import PROMPT, hf_greedy, hf_logits


def test_yarn_qwen3_matches_transformers(tmp_path, host_hardware, cache_dir):
    from helmc import api
    from helmc.runtime.session import Session
    from helmc.testing import make_tiny_model
    d = str(tmp_path / "model")
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
    ref = make_tiny_model(d, "qwen3", rope_parameters=yarn, max_position_embeddings=1024).float().eval()
    assert ref.model.rotary_emb.attention_scaling > 1.1
    bundle = api.build(d, dataclasses.replace(host_hardware, gpu=None, link=None), d + ".bundle",
                       cache_dir=cache_dir, quiet=True).bundle_dir
    s = Session.load(bundle)
    assert s.spec.rope.kind == "yarn"
    ours, theirs = s.forward(PROMPT, all_logits=True), hf_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"\nYaRN qwen3: prefill logits max rel diff {rel:.3e}")
    assert rel <= 1e-4
    expected = hf_greedy(ref, PROMPT, 24)                  # 9 + 24 positions: past the original 16
    assert s.generate(prompt_ids=PROMPT, max_new_tokens=24, stop_at_eos=False).tokens == expected
    assert len(set(expected)) > 1
