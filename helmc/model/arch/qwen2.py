"""Qwen2 (and Qwen2.5): q/k/v biases."""
from helmc.model.arch import Architecture

ARCH = Architecture("Qwen2ForCausalLM", "qwen2", "qwen2", qkv_bias=True, pre_tokenizer="qwen2")
