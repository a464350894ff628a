"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with a routed mixture of experts as the feed-forward of its sparse
blocks; the router and experts' layout is read by helmc/model/moe.py. GGUF `qwen3moe` files are not read yet."""
from helmc.model.arch import Architecture

ARCH = Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", reads_gguf=False, qk_norm=True,
                    pre_tokenizer="qwen2", moe=True)
