"""YaRN RoPE (gpt-oss's: factor 32 over an original 4096, beta_fast 32, beta_slow 1, untruncated ramp; and the
truncated default): the spec read from config.json's rope_parameters as transformers reads them, and the host's
frequencies within two float32 ulps of transformers' and cos / sin tables (attention factor included) within what
that ulp makes of the phase (torch's float32 pow and cos are not correctly rounded: NumPy's differ from them by an
ulp at some arguments)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helmc.errors import HelmcError
from helmc.model.spec import _rope_from_config
from helmc.runtime.rope import RopeTables, inv_freq

GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
           "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


@pytest.mark.parametrize("params,head_dim", [(GPT_OSS, 64), ({**GPT_OSS, "truncate": True}, 64),
                                             ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                               "original_max_position_embeddings": 32768}, 128)],
                         ids=["gpt-oss", "truncated", "defaults"])
def test_yarn_tables_match_transformers(params, head_dim):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    rope = _rope_from_config({"rope_parameters": params, "max_position_embeddings": 131072}, "config.json")
    assert rope.kind == "yarn" and rope.truncate == params.get("truncate", True)
    cfg = GptOssConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, num_hidden_layers=2,
                       rope_parameters=dict(params), max_position_embeddings=131072)
    emb = GptOssRotaryEmbedding(cfg)
    assert rope.attention_factor == pytest.approx(emb.attention_scaling, rel=1e-12) and rope.attention_factor > 1.0
    np.testing.assert_allclose(inv_freq(rope, head_dim), emb.inv_freq.numpy(), rtol=2.5e-7, atol=0)
    positions = np.array([0, 1, 7, 127, 128, 4095, 4096, 40_000, 131_071])
    want_cos, want_sin = emb(torch.zeros(1, dtype=torch.float32), torch.tensor(positions)[None])
    # transformers' tables are [S, D/2] (gpt-oss rotates halves): helmc's rows repeat them over the two halves.
    # An ulp of a frequency turns into position * ulp of phase: the bound grows with the position, as it must.
    bound = rope.attention_factor * (positions[:, None] * emb.inv_freq.numpy()[None] * 2.5e-7 + 2.5e-7)
    tables = RopeTables(rope, head_dim)
    for got_rows in (tables._compute(positions), [np.concatenate(r) for r in zip(*(tables.cos_sin(np.array([p]))
                                                                               for p in positions))]):
        for got, want in zip(got_rows, (want_cos[0].numpy(), want_sin[0].numpy())):
            assert got.shape == (len(positions), head_dim) and got.dtype == np.float32
            assert np.all(np.abs(got[:, :head_dim // 2] - want) <= bound), np.abs(got[:, :head_dim // 2] - want).max()
            assert np.array_equal(got[:, head_dim // 2:], got[:, :head_dim // 2])


def test_yarn_bad_values_are_one_line():
    with pytest.raises(HelmcError, match="original_max_position_embeddings expected a positive number"):
        _rope_from_config({"rope_parameters": {"rope_type": "yarn", "factor": 32.0}}, "config.json")
    with pytest.raises(HelmcError, match="truncate expected true or false, found 'no'"):
        _rope_from_config({"rope_parameters": {**GPT_OSS, "truncate": "no"}}, "config.json")
