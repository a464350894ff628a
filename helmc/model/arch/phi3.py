"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's block with q/k/v stored as one qkv_proj and gate/up as one gate_up_proj,
split into the block's names as views of the checkpoint; config.json's sliding_window applies where set (Phi-3-mini's
2047, Phi-4's none). llama.cpp writes it as `phi3`, attn_qkv and ffn_up (gate and up) still fused, split the same way
when read (gguf_spec.fused_slices); helmc's own GGUF writer (--quant) does not write it."""
from helmc.model.arch import Architecture

ARCH = Architecture("Phi3ForCausalLM", "phi3", "phi3", sliding_window=True,
                    fused_projections=True)
