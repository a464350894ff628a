"""Mixtral: Mistral's attention (sliding window always in force) with a routed mixture of experts in every block;
the router and experts' layout is read by helmc/model/moe.py. Its GGUF files are llama's with experts
(llama.expert_count, ffn_gate_inp, ffn_{gate,up,down}_exps stacked per kind): a llama file with experts reads as
Mixtral, top-k always renormalised (llama.cpp's softmax, top-k, renormalise)."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import DENSE_BLOCK, MIXTRAL_MOE_BLOCK, QK_PERMUTED

ARCH = Architecture("MixtralForCausalLM", "mixtral", "llama", reads_gguf=False, reads_gguf_with_experts=True,
                    sliding_window=True, permuted_tensors=dict(QK_PERMUTED), gguf_vocab_and_rope_dims=True, moe=True,
                    moe_naming="mixtral", block_tensors={**DENSE_BLOCK, **MIXTRAL_MOE_BLOCK})
