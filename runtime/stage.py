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


def block_function_name(part: str, phase: str, signature: int = 0) -> str:
    """The compiled function for `part` (pre_attn | post_attn) in `phase` (prefill | decode) of the blocks whose
    weights have type signature `signature` (ModelSpec.block_signatures(): one for unquantized models, two for a
    Q4_K_M file); the compiler names the functions with it and the stage calls them by it."""
    return f"{part}_{phase}" if signature == 0 else f"{part}_{phase}_t{signature}"


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
        # Per block of the stage, its signature's functions: (phase, signature) -> PackedFunc.
        self._signature = [spec.signature_index(i) for i in layers]
        self._pre = {(p, j): vm[block_function_name("pre_attn", p, j)] for p in ("prefill", "decode")
                     for j in set(self._signature)}
        self._post = {(p, j): vm[block_function_name("post_attn", p, j)] for p in ("prefill", "decode")
                      for j in set(self._signature)}

    def forward(self, x, cos, sin, phase: str):
        """x: device tensor [S, H]; cos/sin: device tensors [S, D]; phase: prefill | decode."""
        x = self.run_blocks(x, cos, sin, phase)
        self.kv.advance(x.shape[0])
        return x

    def run_blocks(self, x, cos, sin, phase: str, attn_out=None):
        """The blocks of forward() without committing the KV step. attn_out: (array, the same memory as a
        device tensor [1, h_a*D]) that decode attention writes into, so a captured step converts no array."""
        S = x.shape[0]
        for local, binding in enumerate(self.bindings):
            j = self._signature[local]
            q, k, v = self._pre[(phase, j)](x, cos, sin, *binding.pre)
            self.kv.append(local, self.to_array(k), self.to_array(v))
            if attn_out is not None:
                self.kv.attend(local, self.to_array(q), self.scale, out=attn_out[0])
                attn = attn_out[1]
            else:
                o = self.kv.attend(local, self.to_array(q), self.scale)      # [S, h_a, D]
                attn = self.from_array(o.reshape(S, self.spec.q_dim))        # [S, h_a, D] -> [S, h_a*D]
            x = self._post[(phase, j)](x, attn, *binding.post)
        return x

    def forward_batch(self, x, cos, sin, caches: list, rows: list[int]):
        """Several sequences in one step: x [sum(rows), H], cos/sin [sum(rows), D] (each row at its own sequence's
        position); sequence b owns the next rows[b] rows and its own KV cache caches[b]. The compiled functions are
        position-wise, so one call per block serves every row (each weight read once per step for all sequences)
        and only attention runs per sequence, on its own cache. rows of 1 each: a batched decode step."""
        S = x.shape[0]
        assert len(caches) == len(rows) and sum(rows) == S, (len(caches), rows, S)
        phase = "decode" if S == 1 else "prefill"          # the prefill variants take any number of rows
        starts = [sum(rows[:b]) for b in range(len(rows))]
        for local, binding in enumerate(self.bindings):
            j = self._signature[local]
            q, k, v = self._pre[(phase, j)](x, cos, sin, *binding.pre)
            q, k, v = self.to_array(q), self.to_array(k), self.to_array(v)
            outs = []
            for kv, a, n in zip(caches, starts, rows):
                kv.append(local, k[a:a + n], v[a:a + n])
                outs.append(kv.attend(local, q[a:a + n], self.scale).reshape(n, self.spec.q_dim))  # [n, h_a, D] -> [n, h_a*D]
            o = outs[0] if len(outs) == 1 else _array_module(outs[0]).concatenate(outs)             # [S, h_a*D]
            x = self._post[(phase, j)](x, self.from_array(o), *binding.post)
        for kv, n in zip(caches, rows):
            kv.advance(n)
        return x


def _array_module(a):
    """NumPy for host arrays, CuPy for device ones (imported only when a GPU stage hands us its arrays)."""
    if type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    import numpy
    return numpy

