"""Export phase: the transformer block, split where the runtime drives attention, through ONNX.

Three position-wise functions are exported with torch.onnx.export(dynamo=True) and a symbolic
sequence length `seq`; weights are graph inputs (HF layout [out, in], checkpoint dtype), so one
compiled function serves every layer and a build needs config.json only:

  pre_attn(x[seq,H], cos[seq,D], sin[seq,D], *w_pre)  -> q[seq,h_a,D], k[seq,h_kv,D], v[seq,h_kv,D]
  post_attn(x[seq,H], attn[seq,h_a*D], *w_post)       -> x'[seq,H]
  head(x[seq,H], norm_w[H], lm_head_w[V,H])           -> logits[seq,V] (float32)

Attention itself sits between pre_attn and post_attn in the runtime because the KV cache is paged
and lives on different devices per stage (thesis 4.2). This module imports torch and onnx: it is
compiler-side only.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass

from helmc.model.spec import ModelSpec

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class ExportedFunction:
    name: str                     # pre_attn | post_attn | head
    onnx_bytes: bytes
    input_names: tuple[str, ...]  # activations first, then weights in runtime binding order
    weight_names: tuple[str, ...] # HF names relative to model.layers.{i}. (blocks) or the model root (head)


def block_ops(spec: ModelSpec, act_dtype: str):
    """(rms_norm, linear) as every exported function computes them, activations in `act_dtype`."""
    import torch
    import torch.nn.functional as F

    act, eps, offset = getattr(torch, act_dtype), spec.rms_norm_eps, spec.norm_offset

    def rms_norm(t, w):
        # x*x instead of pow(x, 2): CUDA fast-math powf of a negative base is NaN (device-notes).
        t32 = t.to(torch.float32)
        var = (t32 * t32).mean(-1, keepdim=True)
        w32 = w.to(torch.float32) + offset if offset else w.to(torch.float32)    # Gemma: x * (1 + w), in fp32
        return (w32 * (t32 * torch.rsqrt(var + eps))).to(act)

    def linear(t, w, b=None):
        return F.linear(t, w.to(act), None if b is None else b.to(act))
    return rms_norm, linear


def _modules(spec: ModelSpec, act_dtype: str):
    import torch
    import torch.nn.functional as F

    act = getattr(torch, act_dtype)
    D = spec.head_dim
    rms_norm, linear = block_ops(spec, act_dtype)

    def rotate_half(t):
        return torch.cat([-t[..., D // 2:], t[..., : D // 2]], dim=-1)

    class PreAttn(torch.nn.Module):
        # Fixed arity (torch.export needs one tensor per argument); unused trailing ones stay None.
        def forward(self, x, cos, sin, w0, w1, w2, w3, w4=None, w5=None, w6=None, w7=None, w8=None):
            it = iter((w0, w1, w2, w3, w4, w5, w6, w7, w8))
            ln, wq, wk, wv = next(it), next(it), next(it), next(it)
            bq = bk = bv = None
            if spec.qkv_bias:
                bq, bk, bv = next(it), next(it), next(it)
            S = x.shape[0]
            h = rms_norm(x, ln)
            q = linear(h, wq, bq).reshape(S, spec.num_heads, D)     # [S, Q] -> [S, h_a, D]
            k = linear(h, wk, bk).reshape(S, spec.num_kv_heads, D)  # [S, KV] -> [S, h_kv, D]
            v = linear(h, wv, bv).reshape(S, spec.num_kv_heads, D)  # [S, KV] -> [S, h_kv, D]
            if spec.qk_norm:
                q, k = rms_norm(q, next(it)), rms_norm(k, next(it))
            c, s = cos[:, None, :].to(act), sin[:, None, :].to(act)  # [S, D] -> [S, 1, D]
            return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v

    def gate(t):
        return F.gelu(t, approximate="tanh") if spec.hidden_act == "gelu_pytorch_tanh" else F.silu(t)

    class PostAttn(torch.nn.Module):
        # o_proj's bias (o_bias) follows its weight; fixed arity as PreAttn's, the last one None without it.
        def forward(self, x, attn, wo, w1, w2, w3, w4, w5=None):
            bo, ln2, wg, wu, wd = (w1, w2, w3, w4, w5) if spec.o_bias else (None, w1, w2, w3, w4)
            h = x + linear(attn, wo, bo)
            m = rms_norm(h, ln2)
            return h + linear(gate(linear(m, wg)) * linear(m, wu), wd)

    class SandwichPostAttn(torch.nn.Module):
        # Gemma: the attention output and the MLP output are each normed before their residual add.
        def forward(self, x, attn, wo, ln_attn_out, ln_pre_ffn, ln_post_ffn, wg, wu, wd):
            assert not spec.o_bias, "sandwich norms with an o_proj bias: no architecture has both"
            h = x + rms_norm(linear(attn, wo), ln_attn_out)
            m = rms_norm(h, ln_pre_ffn)
            return h + rms_norm(linear(gate(linear(m, wg)) * linear(m, wu), wd), ln_post_ffn)

    class Head(torch.nn.Module):
        def forward(self, x, norm_w, lm_w):
            return linear(rms_norm(x, norm_w), lm_w).to(torch.float32)

    return PreAttn(), SandwichPostAttn() if spec.sandwich_norms else PostAttn(), Head()


def export_functions(spec: ModelSpec, act_dtype: str = "float32", example_seq: int = 3) -> tuple[ExportedFunction, ...]:
    """Export pre_attn, post_attn and head to ONNX with a symbolic sequence length."""
    import logging
    import torch

    # torch.onnx logs a warning per missing torchvision op on every export.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    if act_dtype not in _TORCH_DTYPES:
        raise ValueError(f"act_dtype must be one of {sorted(_TORCH_DTYPES)}, got {act_dtype}")
    wdt = getattr(torch, spec.dtype)
    act = getattr(torch, act_dtype)
    S, H, D = example_seq, spec.hidden_size, spec.head_dim
    shapes = spec.block_weight_shapes()
    pre, post, head = _modules(spec, act_dtype)

    def weights(names, shape_of):
        return tuple(torch.zeros(shape_of(n), dtype=wdt) for n in names)

    pre_w = spec.pre_attn_weight_names()
    post_w = spec.post_attn_weight_names()
    head_w = spec.head_weight_names()
    head_shapes = {head_w[0]: (H,), head_w[1]: (spec.vocab_size, H)}
    jobs = [
        ("pre_attn", pre, (torch.zeros(S, H, dtype=act), torch.zeros(S, D), torch.zeros(S, D)) + weights(pre_w, shapes.get),
         ("x", "cos", "sin"), pre_w, ("q", "k", "v")),
        ("post_attn", post, (torch.zeros(S, H, dtype=act), torch.zeros(S, spec.q_dim, dtype=act)) + weights(post_w, shapes.get),
         ("x", "attn"), post_w, ("y",)),
        ("head", head, (torch.zeros(S, H, dtype=act),) + weights(head_w, head_shapes.get),
         ("x",), head_w, ("logits",)),
    ]
    if spec.moe is not None:                # routed blocks: post_moe and the expert function (export_moe.py)
        from helmc.compiler.passes.export_moe import moe_jobs
        jobs += moe_jobs(spec, act_dtype, example_seq, *block_ops(spec, act_dtype))
    return export_jobs(jobs)


def export_jobs(jobs) -> tuple[ExportedFunction, ...]:
    """Each (name, module, example args, activation names, weight names, output names) through
    torch.onnx.export, the activations' first dimension symbolic (`seq`)."""
    import torch
    seq = torch.export.Dim("seq", min=1, max=1 << 20)
    out = []
    for name, module, args, act_names, wnames, outputs in jobs:
        input_names = act_names + tuple(f"w{i}" for i in range(len(wnames)))
        dyn = tuple({0: seq} for _ in act_names) + (None,) * len(wnames)
        # The exporter narrates each step on stdout; a build prints its own phases instead.
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dyn, input_names=list(input_names),
                                     output_names=list(outputs), optimize=True, verbose=False)
        out.append(ExportedFunction(name, prog.model_proto.SerializeToString(), input_names, wnames))
    return tuple(out)
