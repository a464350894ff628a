"""Export phase, mixture-of-experts blocks: the two position-wise functions a routed block adds (helmc/model/moe.py).

  post_moe(x[seq,H], attn[seq,h_a*D], w_o, ln2, w_router) -> h[seq,H], m[seq,H], logits[seq,E] (float32)
      h = x + o_proj(attn) (the residual), m = RMSNorm(h) (the experts' input), logits = router(m)
  expert(m[seq,H], w_gate[I,H], w_up[I,H], w_down[H,I])   -> y[seq,H] (float32)
      down(silu(gate(m)) * up(m)): lower_linear fuses gate/up + SwiGLU into one GEMV for decode rows

Weights are parameters, so one compiled expert function serves every expert of every block and the build does
not grow with the number of experts or blocks. The runtime (runtime/moe_experts.py) routes between them.
"""
from __future__ import annotations

from helmc.model.spec import ModelSpec


def moe_jobs(spec: ModelSpec, act_dtype: str, example_seq: int, rms_norm, linear) -> list:
    """export_block.export_jobs's entries for post_moe and expert; rms_norm and linear as export_block.block_ops
    makes them (the dense functions' own)."""
    import torch
    import torch.nn.functional as F

    act, wdt = getattr(torch, act_dtype), getattr(torch, spec.dtype)
    moe, S, H = spec.moe, example_seq, spec.hidden_size
    I = moe.expert_intermediate_size

    class PostMoe(torch.nn.Module):
        def forward(self, x, attn, wo, ln2, wr):
            h = x + linear(attn, wo)
            m = rms_norm(h, ln2)
            return h, m, linear(m, wr).to(torch.float32)

    class Expert(torch.nn.Module):
        def forward(self, m, wg, wu, wd):
            return linear(F.silu(linear(m, wg)) * linear(m, wu), wd).to(torch.float32)

    def zeros(*shape, dtype=wdt):
        return torch.zeros(*shape, dtype=dtype)
    return [
        ("post_moe", PostMoe(), (zeros(S, H, dtype=act), zeros(S, spec.q_dim, dtype=act), zeros(H, spec.q_dim), zeros(H),
                                 zeros(moe.num_experts, H)),
         ("x", "attn"), ("self_attn.o_proj.weight", "post_attention_layernorm.weight", moe.router_name),
         ("h", "m", "logits")),
        ("expert", Expert(), (zeros(S, H, dtype=act), zeros(I, H), zeros(I, H), zeros(H, I)),
         ("m",), ("gate", "up", "down"), ("y",)),
    ]
