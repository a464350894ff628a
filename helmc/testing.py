"""Tiny random-weight models in real architectures, made locally (no hub access anywhere).

Used by the tests and the demo: a Hugging Face model directory (config.json,
model.safetensors, tokenizer.json) written by transformers' own save_pretrained, so helmc reads
exactly what a user's checkpoint looks like. Needs torch and transformers (test/compile side only).
"""
from __future__ import annotations

import dataclasses
import re

import os

import numpy as np

TINY_DIMS = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6)

_CORPUS = """helmc compiles a language model for one CPU and one GPU. The first blocks run on the CPU
and the rest on the GPU, and only one activation crosses PCIe per token. Pages of the KV cache move
to pinned host memory when the GPU runs short, and attention streams over them with an online
softmax. The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that
wanted to be fast. It read its weights straight from disk, tensor by tensor, and never kept a second
copy. Numbers one two three four five six seven eight nine ten. Hello world!"""


def make_tokenizer(path: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a built-in text; ids < vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(path)
    return tok


def tiny_config(arch: str, num_layers: int = 2, head_dim: int = 32, dtype: str = "float32", tie: bool | None = None, **over):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    dims = dict(TINY_DIMS, num_hidden_layers=num_layers, **over)
    common = dict(dims, bos_token_id=0, eos_token_id=0, dtype=dtype)
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=head_dim, tie_word_embeddings=True if tie is None else tie, rope_theta=1000000.0, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=False if tie is None else tie, rope_theta=1000000.0, **common)
    elif arch == "llama":
        cfg = LlamaConfig(head_dim=head_dim, tie_word_embeddings=False if tie is None else tie, **common)
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        moe = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=48,
                   mlp_only_layers=[1] if num_layers > 2 else [])
        moe.update({k: common.pop(k) for k in list(moe) if k in common})
        cfg = Qwen3MoeConfig(head_dim=head_dim, tie_word_embeddings=False if tie is None else tie, rope_theta=1000000.0,
                             **moe, **common)
    elif arch == "mixtral":
        from transformers import MixtralConfig
        common.update({k: v for k, v in dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2).items()
                       if k not in over})
        cfg = MixtralConfig(head_dim=head_dim, tie_word_embeddings=False if tie is None else tie, sliding_window=None,
                            **common)
    elif arch == "mistral":
        cfg = MistralConfig(head_dim=head_dim, tie_word_embeddings=False if tie is None else tie, sliding_window=None, **common)
    elif arch == "phi3":        # head_dim is hidden / heads (Phi3Config has no key of its own for it)
        from transformers import Phi3Config
        cfg = Phi3Config(tie_word_embeddings=False if tie is None else tie, pad_token_id=0, **common)
    elif arch == "gemma3":      # head_dim (32) is not hidden / heads; sliding window 8 beside global blocks
        from transformers import Gemma3TextConfig
        kinds = ("sliding_attention", "sliding_attention", "full_attention")
        gemma = dict(sliding_window=8, query_pre_attn_scalar=24, layer_types=[kinds[i % 3] for i in range(num_layers)],
                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        gemma.update({k: over[k] for k in gemma if k in over})
        common.update({k: v for k, v in over.items() if k not in gemma})
        cfg = Gemma3TextConfig(head_dim=head_dim, tie_word_embeddings=True if tie is None else tie, pad_token_id=0,
                               **gemma, **{k: v for k, v in common.items() if k not in gemma})
    elif arch == "gpt_oss":     # head_dim 32 != hidden / heads; window 8 on blocks 0, 2, ...; YaRN; 8 experts, top-3
        from transformers import GptOssConfig
        oss = dict(sliding_window=8, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
                   intermediate_size=48, num_local_experts=8, num_experts_per_tok=3, swiglu_limit=0.5,
                   max_position_embeddings=2048, rope_parameters={
                       "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                       "original_max_position_embeddings": 64, "truncate": False})
        oss.update({k: over[k] for k in oss if k in over})
        cfg = GptOssConfig(head_dim=head_dim, tie_word_embeddings=False if tie is None else tie, pad_token_id=0,
                           **oss, **{k: v for k, v in common.items() if k not in oss})
    else:
        raise ValueError(f"unknown tiny architecture {arch}")
    return cfg


def make_tiny_model(out_dir: str, arch: str = "qwen3", num_layers: int = 2, head_dim: int = 32,
                    dtype: str = "float32", seed: int = 0, tie: bool | None = None, max_shard_size: str | None = None, **over):
    """Write a random-weight HF model directory; returns the transformers model (float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, num_layers, head_dim, dtype, tie, **over)
    cfg.architectures = [type(cfg).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                # Gemma's norms scale by (1 + w), its w centred on 0; spread wide, since with tied embeddings
                # scaled by sqrt(hidden) a narrow spread makes greedy decoding repeat the prompt's last token
                centre, spread = (0.0, 1.0) if arch == "gemma3" else (1.0, 0.1)
                p.copy_(centre + spread * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
            elif arch == "gpt_oss" and name.endswith("sinks"):
                p.normal_(0, 1.0)          # a sink of the logits' own size: a wrong denominator shows
            else:
                p.normal_(0, 0.08)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    save = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    save.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    make_tokenizer(os.path.join(out_dir, "tokenizer.json"), vocab_size=min(512, cfg.vocab_size))
    return save


def hf_reference(model_dir: str):
    """transformers' model of `model_dir` in fp32, eval, as every comparison loads it. gpt-oss: transformers before
    5.24 (the GPU machine's 5.17) fixed its experts' SwiGLU at alpha 1.702 and limit 7 whatever the config said,
    where later ones read swiglu_alpha / swiglu_limit; the config's values are set on every expert module here, so a
    model whose clamp differs from llama.cpp's fixed 7 is compared with what its config asks on either version."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha") and hasattr(cfg, "swiglu_limit"):
            module.limit, module.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    return model


def hf_prompt_reference(model, prompt: list[int], new_tokens: int):
    """(last-row logits of `prompt` as a NumPy array, the greedy continuation of `new_tokens` ids) from a
    transformers causal LM, as the device checks store them in refs.npz."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        logits = model(ids).logits[0, -1].float().numpy()
        greedy = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)[0, len(prompt):]
    return logits, greedy.numpy()


def hf_on_dequantized_weights(model_dir: str, gguf_path: str):
    """The transformers model of `model_dir` in fp32 with every weight replaced by the gguf package's own
    dequantization of `gguf_path`'s tensor (the reference for quantized bundles; not helmc's dequantizers)."""
    import gguf
    import numpy as np
    import torch

    from helmc.runtime.weights.gguf_mmap import GGUFCheckpoint
    model = hf_reference(model_dir)
    ck = GGUFCheckpoint(gguf_path)
    params = dict(model.named_parameters())
    # an expert's weight (Qwen3-MoE's names, or Mixtral's w1 / w3 / w2) -> transformers' stacked experts
    expert = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
    kinds = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
    for name in ck.names():
        info = ck.info(name)
        w = gguf.quants.dequantize(np.ascontiguousarray(ck.raw_hf(name)), gguf.GGMLQuantizationType[info.type.upper()])
        w = torch.from_numpy(np.array(w, dtype=np.float32).reshape(info.shape))   # a writable copy (F16/F32 map read-only)
        if name == "lm_head.weight" and name not in params:          # tied in HF, its own tensor in the file
            model.lm_head.weight = torch.nn.Parameter(w)
            continue
        m = expert.fullmatch(name) if name not in params else None
        stem = f"{m.group(1)}.mlp.experts" if m else ""
        with torch.no_grad():
            if m is None:                       # Mixtral's router is mlp.gate in transformers
                params[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")].copy_(w)
            elif kinds[m.group(3)] == "down":   # transformers' experts: down_proj [E, H, I]
                params[f"{stem}.down_proj"][int(m.group(2))].copy_(w)
            else:                               # gate_up_proj [E, 2I, H]: gate's rows, then up's
                rows = w.shape[0]
                half = slice(0, rows) if kinds[m.group(3)] == "gate" else slice(rows, 2 * rows)
                params[f"{stem}.gate_up_proj"][int(m.group(2)), half].copy_(w)
    if "lm_head.weight" in params and "lm_head.weight" in ck.names():
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr() or \
            np.array_equal(ck.raw_hf("lm_head.weight"), ck.raw_hf("model.embed_tokens.weight"))
    ck.close()
    return model


# gpt-oss as llama.cpp writes it (a `gpt-oss` GGUF) from a tiny HF directory, and transformers on its weights: the
# GGUF tests' and the GPU tests' (tests/device/build_gpt_oss_gpu_bundles.py) one home.
_GPT_OSS_EXPERT_STACKS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


def _gguf_quantized(x: np.ndarray, qtype: str | None):
    import gguf
    if qtype is None:
        return np.ascontiguousarray(x, np.float32), None
    t = gguf.GGMLQuantizationType[qtype.upper()]
    return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), t), t


def write_gpt_oss_gguf(model_dir: str, path: str, experts: str | None = None, linears: str | None = None,
                       embed: str | None = None) -> None:
    """The HF directory as a `gpt-oss` GGUF: F32 everywhere, or the experts in `experts`, the attention's and the
    head's linears in `linears` and the token embedding in `embed` (GGUF type names; F16 makes the spec's dtype
    float16, as the GPU's one-call decode rows need); norms, biases, sinks and the router F32."""
    import gguf
    from safetensors.numpy import load_file

    from helmc.model.gguf_spec import gguf_name
    from helmc.model.spec import ModelSpec
    spec = ModelSpec.from_model_dir(model_dir)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(spec.num_layers); w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size); w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads); w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim); w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope.theta); w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN); w.add_rope_scaling_factor(spec.rope.factor)
    w.add_rope_scaling_orig_ctx_len(spec.rope.original_max_position)
    w.add_sliding_window(spec.sliding_window)
    w.add_expert_count(spec.moe.num_experts); w.add_expert_used_count(spec.moe.top_k)
    w.add_expert_feed_forward_length(spec.moe.expert_intermediate_size)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("gpt-4o")
    w.add_token_list([f"t{i}" for i in range(spec.vocab_size)]); w.add_token_merges(["t 1"])
    for name, x in t.items():
        x = np.asarray(x, np.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):          # [E, H, 2I], gate / up interleaved -> [E, I, H] each
            for kind, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                data, raw = _gguf_quantized(x[:, :, cols].transpose(0, 2, 1), experts)
                w.add_tensor(f"blk.{layer}.{_GPT_OSS_EXPERT_STACKS[kind]}.weight", data, raw_dtype=raw)
        elif name.endswith("mlp.experts.down_proj"):           # [E, I, H] -> [E, H, I]
            data, raw = _gguf_quantized(x.transpose(0, 2, 1), experts)
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", data, raw_dtype=raw)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):   # [E, 2I] -> [E, I] each
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(x[:, 0::2]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(x[:, 1::2]))
        elif name.endswith("mlp.experts.down_proj_bias"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.bias", x)
        elif x.ndim == 2 and "router" not in name:
            data, raw = _gguf_quantized(x, embed if "embed_tokens" in name else linears)
            w.add_tensor(gguf_name(name, "GptOssForCausalLM"), data, raw_dtype=raw)
        else:
            w.add_tensor(gguf_name(name, "GptOssForCausalLM"), x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def hf_on_gpt_oss_gguf(model_dir: str, gguf_path: str):
    """The transformers model of `model_dir` in fp32 with every weight the gguf package's dequantization of the
    file's tensor, put back into transformers' fused experts (gate / up interleaved, transposed)."""
    import gguf
    import torch

    from helmc.runtime.weights.gguf_mmap import GGUFCheckpoint
    model = hf_reference(model_dir)
    params = dict(model.named_parameters())
    ck = GGUFCheckpoint(gguf_path)
    for name in ck.names():
        info = ck.info(name)
        x = gguf.quants.dequantize(np.ascontiguousarray(ck.raw_hf(name)), gguf.GGMLQuantizationType[info.type.upper()])
        x = torch.from_numpy(np.array(x, np.float32).reshape(info.shape))
        parts = name.split(".")
        with torch.no_grad():
            if ".mlp.experts." not in name:
                params[name].copy_(x)
                continue
            stem, e, kind, what = ".".join(parts[:5]), int(parts[5]), parts[6], parts[7]
            if kind == "down_proj":
                params[f"{stem}.down_proj" + ("_bias" if what == "bias" else "")][e].copy_(x.T if what == "weight" else x)
            else:
                cols = slice(0, None, 2) if kind == "gate_proj" else slice(1, None, 2)
                if what == "weight":
                    params[f"{stem}.gate_up_proj"][e][:, cols].copy_(x.T)
                else:
                    params[f"{stem}.gate_up_proj_bias"][e][cols].copy_(x)
    ck.close()
    return model


def gpt_oss_20b_config(**over) -> dict:
    """config.json of gpt-oss-20b as published (the keys helmc reads)."""
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
           "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
           "rms_norm_eps": 1e-05, "sliding_window": 128, "attention_bias": True, "swiglu_limit": 7.0,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                  "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                  "truncate": False},
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "eos_token_id": 200002}
    cfg.update(over)
    return cfg


def gguf_typed_gpt_oss(spec):
    """The spec as llama.cpp's gpt-oss files type it: attention Q8_0, experts MXFP4, embedding and head Q8_0."""
    return dataclasses.replace(spec, layer_types=(("q8_0",) * 4 + ("",) * 3,) * spec.num_layers,
                               expert_types=(("mxfp4",) * 3,) * spec.num_layers, head_type="q8_0", embed_type="q8_0")
