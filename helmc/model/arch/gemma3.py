"""Gemma 3 (Gemma3ForCausalLM, the text model): q/k RMSNorm, RMSNorm as x * (1 + w), norms on the attention and MLP
outputs before the residual adds, a GeGLU MLP (gelu_pytorch_tanh; config.json's hidden_activation), token embeddings
scaled by sqrt(hidden_size), the attention scaled by query_pre_attn_scalar ** -0.5, tied embeddings, and sliding-window
layers (RoPE base rope_local_base_freq) interleaved with global ones (rope_theta and its scaling). llama.cpp writes it
as `gemma3`, its norm weights stored as w + 1 (the GGUF reader's spec then has norm_offset 0); helmc's own GGUF
writer does not write it, so `--quant` is refused for it."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import GEMMA_BLOCK

ARCH = Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma3", qk_norm=True, sliding_window=True,
                    block_tensors=dict(GEMMA_BLOCK), pre_tokenizer="default", norm_offset=1.0,
                    sandwich_norms=True, scaled_embeddings=True, local_rope=True)
