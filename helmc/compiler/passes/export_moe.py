"""Export phase, mixture-of-experts blocks: the two position-wise functions a routed block adds (helmc/model/moe.py).

  post_moe(x[seq,H], attn[seq,h_a*D], w_o, ln2, w_router) -> h[seq,H], m[seq,H], logits[seq,E] (float32)
      h = x + o_proj(attn) (the residual), m = RMSNorm(h) (the experts' input), logits = router(m)
      (gpt-oss: o_proj's bias after w_o, the router's after w_router: ModelSpec.post_attn_weight_names)
  expert(m[seq,H], w_gate[I,H], w_up[I,H], w_down[H,I])   -> y[seq,H] (float32)
      down(silu(gate(m)) * up(m)): lower_linear fuses gate/up + SwiGLU into one GEMV for decode rows;
      gpt-oss: b_gate[I], b_up[I], b_down[H] after the weights, and the clamped SwiGLU
      down((clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)), g = min(gate, l) (MoeSpec.expert_act)

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
        # Fixed arity (torch.export needs one tensor per argument): the biases, where present, after their weights.
        def forward(self, x, attn, w0, w1, w2, w3=None, w4=None):
            it = iter((w0, w1, w2, w3, w4))
            wo = next(it)
            bo = next(it) if spec.o_bias else None
            ln2, wr = next(it), next(it)
            br = next(it) if moe.router_bias else None
            h = x + linear(attn, wo, bo)
            m = rms_norm(h, ln2)
            return h, m, linear(m, wr, br).to(torch.float32)

    def activation(g, u):
        if moe.expert_act == "swiglu_clamped":
            # where, not clamp: the exporter makes ONNX Clip of clamp (and of min / max), which the importer makes
            # TE functions outside the one function import_relax takes
            limit = torch.tensor(moe.swiglu_limit, dtype=g.dtype)
            g = torch.where(g > limit, limit, g)
            u = torch.where(u > limit, limit, torch.where(u < -limit, -limit, u))
            return (u + 1) * (g * torch.sigmoid(g * moe.swiglu_alpha))
        return F.silu(g) * u

    class Expert(torch.nn.Module):
        def forward(self, m, wg, wu, wd, bg=None, bu=None, bd=None):
            return linear(activation(linear(m, wg, bg), linear(m, wu, bu)), wd, bd).to(torch.float32)

    def zeros(*shape, dtype=wdt):
        return torch.zeros(*shape, dtype=dtype)
    # post_moe's weights in ModelSpec.post_attn_weight_names' order: o_proj (+ bias), the norm, the router (+ bias)
    shapes = {"self_attn.o_proj.weight": (H, spec.q_dim), "self_attn.o_proj.bias": (H,),
              "post_attention_layernorm.weight": (H,), moe.router_name: (moe.num_experts, H)}
    if moe.router_bias:
        shapes[moe.router_bias_name] = (moe.num_experts,)
    post_w = tuple(n for n in ("self_attn.o_proj.weight", "self_attn.o_proj.bias" if spec.o_bias else None,
                               "post_attention_layernorm.weight", moe.router_name, moe.router_bias_name) if n)
    biases = (zeros(I), zeros(I), zeros(H)) if moe.expert_bias else ()
    return [
        ("post_moe", PostMoe(), (zeros(S, H, dtype=act), zeros(S, spec.q_dim, dtype=act))
         + tuple(zeros(*shapes[n]) for n in post_w), ("x", "attn"), post_w, ("h", "m", "logits")),
        ("expert", Expert(), (zeros(S, H, dtype=act), zeros(I, H), zeros(I, H), zeros(H, I)) + biases,
         ("m",), ("gate", "up", "down") + (("b_gate", "b_up", "b_down") if moe.expert_bias else ()), ("y",)),
    ]
