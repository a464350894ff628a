"""Mistral: Llama's block with config.json's sliding_window always in force; llama.cpp writes it as a llama file
(which reads back as Llama, without the window)."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import QK_PERMUTED

ARCH = Architecture("MistralForCausalLM", "mistral", "llama", reads_gguf=False, sliding_window=True,
                    permuted_tensors=dict(QK_PERMUTED), gguf_vocab_and_rope_dims=True)
