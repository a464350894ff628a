"""gpt-oss (GptOssForCausalLM): q/k/v and o_proj with biases, a learned logit per attention head in each softmax's
denominator (attention sinks, `self_attn.sinks`, attended by the CPU and GPU KV caches), sliding-window blocks alternating with
full ones (config.json's layer_types), YaRN RoPE, and a routed mixture of experts in every block: the router with a
bias, top-k of its logits then a softmax over those k, each expert's gate, up and down with biases and the clamped
SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up both ways at swiglu_limit). The
checkpoint stores each block's experts fused ([experts, hidden, 2 * inter], gate and up interleaved on the last
axis): the weights reader splits them into one expert's gate, up and down (helmc/model/moe.py's `gpt_oss` naming).
llama.cpp writes it as `gpt-oss`."""
from helmc.model.arch import Architecture
from helmc.model.arch.tensors import GPT_OSS_BLOCK

ARCH = Architecture("GptOssForCausalLM", "gpt_oss", "gpt-oss", sliding_window=True, moe=True, moe_naming="gpt_oss",
                    block_tensors=dict(GPT_OSS_BLOCK), pre_tokenizer="gpt-4o", o_bias=True, attn_sinks=True,
                    alternating_layers=2)
