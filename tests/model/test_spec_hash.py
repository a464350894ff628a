"""The architecture hash names what compiled code depends on: every set field counts, a field at its default does not
(so adding an optional feature to ModelSpec leaves existing bundles' hashes as they were)."""
import dataclasses

from helmc.model.spec import ModelSpec, RopeSpec, _set_fields
from tests.model.test_gguf_reader import hf_config


def test_fields_at_their_defaults_are_left_out_of_the_hash():
    spec = ModelSpec.from_hf_config(hf_config("qwen3"))
    fields = _set_fields(spec)
    assert "local_rope" not in fields and "sandwich_norms" not in fields and "moe" not in fields
    assert fields["hidden_size"] == spec.hidden_size and "theta" in fields["rope"]
    assert "beta_fast" not in fields["rope"]                      # a nested default is left out too


def test_every_set_field_changes_the_hash():
    spec = ModelSpec.from_hf_config(hf_config("qwen3"))
    h = spec.architecture_hash()
    for change in (dict(hidden_act="gelu_pytorch_tanh"), dict(sandwich_norms=True), dict(norm_offset=1.0),
                   dict(intermediate_size=spec.intermediate_size * 2),
                   dict(local_rope=RopeSpec(theta=10000.0)), dict(rope=dataclasses.replace(spec.rope, factor=2.0))):
        assert dataclasses.replace(spec, **change).architecture_hash() != h, change
    assert dataclasses.replace(spec, bos_token_id=7, max_position_embeddings=99).architecture_hash() == h
