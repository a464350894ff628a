"""Qwen3: RMSNorm over each q and k head before RoPE; no biases."""
from helmc.model.arch import Architecture

ARCH = Architecture("Qwen3ForCausalLM", "qwen3", "qwen3", qk_norm=True, pre_tokenizer="qwen2")
