"""A stage: the contiguous run of transformer blocks that one device executes (thesis 4.1.4).

Every block of a stage calls the same two compiled functions with that block's weights:
    q, k, v = pre_attn(x, cos, sin, *w_pre[i])
    o       = kv.append(i, k, v); kv.attend(i, q)
    x       = post_attn(x, o, *w_post[i])
The stage holds no placement logic: which blocks it owns was fixed by the plan at build time.
The device-specific parts are the array conversions (NumPy on the CPU, CuPy on the GPU) and the
KV cache object; the loop is the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from helmc.model.spec import ModelSpec


@dataclass
class StageBinding:
    """Weights of one block, already on the stage's device, in the compiled functions' order."""
    pre: list
    post: list


class Stage:
    def __init__(self, name: str, vm, spec: ModelSpec, layers: range, kv, bindings: list[StageBinding],
                 to_array: Callable[[Any], Any], from_array: Callable[[Any], Any]):
        assert len(bindings) == len(layers), "one weight binding per block of the stage"
        self.name = name
        self.vm = vm
        self.spec = spec
        self.layers = layers
        self.kv = kv
        self.bindings = bindings
        self.to_array = to_array        # device tensor -> NumPy/CuPy array (zero-copy where possible)
        self.from_array = from_array    # NumPy/CuPy array -> device tensor
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self._pre = {p: vm[f"pre_attn_{p}"] for p in ("prefill", "decode")}
        self._post = {p: vm[f"post_attn_{p}"] for p in ("prefill", "decode")}

    def forward(self, x, cos, sin, phase: str):
        """x: device tensor [S, H]; cos/sin: device tensors [S, D]; phase: prefill | decode."""
        pre, post = self._pre[phase], self._post[phase]
        S = x.shape[0]
        for local, binding in enumerate(self.bindings):
            q, k, v = pre(x, cos, sin, *binding.pre)
            self.kv.append(local, self.to_array(k), self.to_array(v))
            o = self.kv.attend(local, self.to_array(q), self.scale)          # [S, h_a, D]
            attn = self.from_array(o.reshape(S, self.spec.q_dim))            # [S, h_a, D] -> [S, h_a*D]
            x = post(x, attn, *binding.post)
        self.kv.advance(S)
        return x
