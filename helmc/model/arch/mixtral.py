"""Mixtral: Mistral's attention (sliding window always in force) with a routed mixture of experts in every block;
the router and experts' layout is read by helmc/model/moe.py. Its GGUF files (llama with experts) are not read yet."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import QK_PERMUTED

ARCH = Architecture("MixtralForCausalLM", "mixtral", "llama", reads_gguf=False, sliding_window=True,
                    permuted_tensors=dict(QK_PERMUTED), gguf_vocab_and_rope_dims=True, moe=True)
