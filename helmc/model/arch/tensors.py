"""Tensor names of the architectures' blocks: Hugging Face's and llama.cpp's (GGUF), one table read both ways."""

# Outside the blocks: HF name -> GGUF name.
ROOT_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
# A dense decoder block (attention, then a SwiGLU FFN): suffixes under model.layers.N. <-> blk.N.
DENSE_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
# Gemma 2/3's block: the dense block with a norm on the attention output (post_attention_norm) and around the MLP
# (ffn_norm before it, post_ffw_norm after it); HF's post_attention_layernorm is the attention output's norm there.
GEMMA_BLOCK = dict(DENSE_BLOCK, **{
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})
# gpt-oss's block: biases on q/k/v and o_proj, the attention sinks, the MLP's norm as post_attention_norm, the router
# (mlp.router, with its bias) as ffn_gate_inp; its experts' stacks (and their biases) are MOE_EXPERT_TENSORS'.
GPT_OSS_BLOCK = dict(DENSE_BLOCK, **{
    "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias"})
# The GGUF block tensors llama.cpp's llama converter reorders per head (see gguf_spec.qk_rows_to_hf): q's rows per
# attention head ("q"), k's per KV head ("k").
QK_PERMUTED = {"attn_q.weight": "q", "attn_q.bias": "q", "attn_k.weight": "k", "attn_k.bias": "k"}
# Tensors a GGUF may carry that have no HF parameter: llama3 RoPE factors (folded into ModelSpec.rope).
EXTRA_TENSORS = ("rope_freqs.weight",)
# A mixture-of-experts block (Qwen3-MoE): the router, and each kind of expert weight stacked over the experts in one
# 3-D GGUF tensor [experts, rows, cols]; the GGUF reader gives expert e's slice the name blk.N.ffn_gate_exps.{e}.weight.
MOE_BLOCK = {"mlp.gate.weight": "ffn_gate_inp.weight"}
MIXTRAL_MOE_BLOCK = {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}     # Mixtral's router, the same tensor
# The stacked GGUF tensors of an expert's gate, up and down weights, in that order (helmc.model.moe.NAMINGS' order).
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MOE_EXPERT_TENSORS = dict(zip(("gate_proj", "up_proj", "down_proj"), EXPERT_STACKS))
