"""Llama: the plain block; llama.cpp's converter permutes q/k rows per head and writes vocab and RoPE dims."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import QK_PERMUTED

ARCH = Architecture("LlamaForCausalLM", "llama", "llama", permuted_tensors=dict(QK_PERMUTED),
                    gguf_vocab_and_rope_dims=True)
