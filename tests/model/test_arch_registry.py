"""The architecture registry: each entry against what transformers and llama.cpp's gguf package say of it, and the
spec readers asking it."""
import pytest

from helmc.errors import HelmcError
from helmc.model.arch import ARCHITECTURES, GGUF_ARCHITECTURES, architecture, gguf_architecture
from helmc.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec

_CONFIG = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "rms_norm_eps": 1e-6, "sliding_window": 128,
           "torch_dtype": "float16"}


def test_entries_are_transformers_classes_and_gguf_architectures():
    import transformers
    gguf = pytest.importorskip("gguf")
    gguf_names = set(gguf.MODEL_ARCH_NAMES.values())
    assert SUPPORTED_ARCHITECTURES == tuple(ARCHITECTURES)
    for hf, a in ARCHITECTURES.items():
        assert a.hf_class == hf and hasattr(transformers, hf)
        assert transformers.AutoConfig.for_model(a.model_type).model_type == a.model_type
        assert a.gguf_arch in gguf_names, a.gguf_arch
        assert set(a.permuted_tensors) <= set(a.block_tensors.values())
    # every GGUF name reads back as exactly one entry, which writes it
    assert {g: a.gguf_arch for g, a in GGUF_ARCHITECTURES.items()} == {g: g for g in GGUF_ARCHITECTURES}
    assert gguf_architecture("llama").hf_class == "LlamaForCausalLM" and gguf_architecture("gpt2") is None
    # llama.cpp writes Mixtral as llama with experts; every entry's expert names are a naming helmc.model.moe has
    assert gguf_architecture("llama", experts=True).hf_class == "MixtralForCausalLM"
    assert gguf_architecture("qwen3moe", experts=True).hf_class == "Qwen3MoeForCausalLM"
    from helmc.model.moe import NAMINGS
    assert all(a.moe_naming in NAMINGS for a in ARCHITECTURES.values())


@pytest.mark.parametrize("hf", [n for n, a in ARCHITECTURES.items() if not a.moe])   # MoE configs: tests/compiler/test_moe.py
def test_config_reading_follows_the_entry(hf):
    a = architecture(hf)
    spec = ModelSpec.from_hf_config({**_CONFIG, "architectures": [hf]})
    assert (spec.qkv_bias, spec.qk_norm, spec.sliding_window) == (a.qkv_bias, a.qk_norm, 128 if a.sliding_window else 0)
    # the config's own switches add to what the architecture always has
    on = ModelSpec.from_hf_config({**_CONFIG, "architectures": [hf], "attention_bias": True, "use_sliding_window": True})
    assert on.qkv_bias and on.sliding_window == 128


def test_unknown_architecture_is_one_clear_error():
    with pytest.raises(HelmcError, match="architecture expected one of .*Qwen3ForCausalLM.*found 'GPT2LMHeadModel'"):
        architecture("GPT2LMHeadModel")
    with pytest.raises(HelmcError, match="architectures expected one of"):
        ModelSpec.from_hf_config({**_CONFIG, "architectures": ["GPT2LMHeadModel"]})


def test_gguf_permutation_and_writer_names_come_from_the_entry():
    from helmc.compiler.quantize_checkpoint import _GGUF_ARCH
    from helmc.model.gguf_spec import permuted_heads
    spec = ModelSpec.from_hf_config({**_CONFIG, "architectures": ["LlamaForCausalLM"]})
    assert _GGUF_ARCH == {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                          "MistralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe",
                          "MixtralForCausalLM": "llama"}
    assert permuted_heads("llama", spec, "blk.0.attn_q.weight") == 4
    assert permuted_heads("llama", spec, "blk.0.attn_k.bias") == 2
    assert permuted_heads("qwen2", spec, "blk.0.attn_q.weight") == 0
    assert permuted_heads("llama", spec, "blk.0.attn_v.weight") == 0
