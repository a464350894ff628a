"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with a routed mixture of experts as the feed-forward of its sparse
blocks; the router and experts' layout is read by helmc/model/moe.py. GGUF `qwen3moe` files: the router as
ffn_gate_inp, the experts stacked per kind (ffn_{gate,up,down}_exps), top-k always renormalised (llama.cpp's)."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import DENSE_BLOCK, MOE_BLOCK

ARCH = Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", qk_norm=True, pre_tokenizer="qwen2", moe=True,
                    block_tensors={**DENSE_BLOCK, **MOE_BLOCK})
