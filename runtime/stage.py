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

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from helmc.model.spec import ModelSpec
from helmc.runtime.kv.interface import KVCache
from helmc.runtime.rope import rope_half
from helmc.runtime.function_names import batch_phase, block_function_name  # noqa: F401 (the stage's names)


def decode_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes > 1 that get a batched decode variant for a plan of `max_batch` sequences: powers of two
    below it and itself (8 -> 2, 4, 8); a step of b sequences runs the smallest of them >= b on padded rows.
    Few variants keep the build short (one compile per size, whatever the depth), and a padded row costs a
    memory-bound step little."""
    sizes = {max_batch} if max_batch > 1 else set()
    b = 2
    while b < max_batch:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


def decode_step_rows(rows: list[int], sizes: tuple[int, ...]) -> int:
    """Rows a step of sequences with rows[b] new tokens each runs on: a batched decode step (every sequence one
    token, several sequences) pads to the smallest of `sizes` (decode_batch_sizes) that holds them; any other
    step runs on its own rows."""
    if len(rows) > 1 and all(n == 1 for n in rows):
        fits = [b for b in sizes if b >= len(rows)]
        assert fits, f"a batched decode step of {len(rows)} sequences, compiled for {sizes}"
        return fits[0]
    return sum(rows)


@dataclass
class StageBinding:
    """Weights of one block, already on the stage's device, in the compiled functions' order."""
    pre: list
    post: list


class Stage:
    def __init__(self, name: str, vm, spec: ModelSpec, layers: range, kv: KVCache, bindings: list[StageBinding],
                 to_array: Callable[[Any], Any], from_array: Callable[[Any], Any], batch_sizes: tuple[int, ...] = (),
                 kv_base: int = 0, gpu_decode_batch=None, moe=None):
        assert len(bindings) == len(layers), "one weight binding per block of the stage"
        assert kv_base >= 0, kv_base
        self.name = name
        self.vm = vm
        self.spec = spec
        self.layers = layers
        self.kv = kv
        self.bindings = bindings
        # Block `local` of the stage is KV layer kv_base + local of its cache (hybrid decode: the GPU cache holds
        # the streamed blocks first, then the resident ones; 0 otherwise).
        self.kv_base = kv_base
        self.to_array = to_array        # device tensor -> NumPy/CuPy array (zero-copy where possible)
        self.from_array = from_array    # NumPy/CuPy array -> device tensor
        self.scale = spec.attention_scale
        # Per block of the stage: whether it takes the local RoPE half of cos/sin (Gemma 3's sliding blocks).
        self._local_rope = [spec.layer_rope_local(i) for i in layers]
        # rope_halves' device buffers per decode step's row count: rows -> (cos, sin, their arrays, the halves, the
        # halves' tensors); kept for the session, since a captured step writes and reads them on every replay.
        self._rope_split: dict[int, tuple] = {}
        # Per block of the stage, its signature's functions: (phase, signature) -> PackedFunc.
        self._signature = [spec.signature_index(i) for i in layers]
        self.batch_sizes = tuple(batch_sizes)    # the batched decode variants the bundle holds (decode_batch_sizes)
        phases = ("prefill", "decode") + tuple(batch_phase(b) for b in self.batch_sizes)
        self._pre = {(p, j): vm[block_function_name("pre_attn", p, j)] for p in phases for j in set(self._signature)}
        self._post = {(p, j): vm[block_function_name("post_attn", p, j)] for p in phases for j in set(self._signature)}
        # Mixture of experts: the routed blocks' feed-forward (runtime/moe_experts.py) in place of post_attn.
        self._moe_layer = [spec.is_moe_layer(i) for i in layers]
        self._moe = moe                 # given: the GPU stage's (runtime/moe_gpu.py), its experts on the CPU
        if any(self._moe_layer) and moe is None:
            from helmc.runtime.moe_experts import MoeFeedForward, find_expert_sums
            self._moe = MoeFeedForward(vm, spec.moe, phases, self.batch_sizes, to_array, from_array, self._signature,
                                       [spec.expert_signature_index(i) for i in layers if spec.is_moe_layer(i)],
                                       expert_sums=find_expert_sums(vm, spec),
                                       expert_rows=find_expert_sums(vm, spec, rows=True))
        self._decode_batch = None       # kv.cache_cpu.DecodeBatch, made by the first batched step on host caches
        # kv.decode_batch_gpu.GpuDecodeBatch, by the first on GPU caches, or another stage's over the same caches
        # (shared_gpu_decode_batch)
        self._gpu_decode_batch = gpu_decode_batch

    def forward(self, x, cos, sin, phase: str):
        """x: device tensor [S, H]; cos/sin: device tensors [S, D]; phase: prefill | decode."""
        x = self.run_blocks(x, cos, sin, phase)
        self.kv.advance(x.shape[0])
        return x

    def run_blocks(self, x, cos, sin, phase: str, attn_out=None, blocks: range | None = None):
        """The blocks of forward() without committing the KV step. attn_out: (array, the same memory as a
        device tensor [1, h_a*D]) that decode attention writes into, so a captured step converts no array.
        blocks: the stage's local blocks to run (default all; hybrid decode runs a CPU group at a time)."""
        S = x.shape[0]
        # One token on a host cache with the compiled kernel: DecodeBatch's path for one sequence (the K/V rows
        # written straight into the arena, the kernel's output buffer handed to post_attn as it is; the same
        # kernel and bits as append + attend, without their per-call checks, lookups and copies).
        batch = self._decode_batch_for([self.kv]) if phase == "decode" and S == 1 and attn_out is None else None
        ropes = self.rope_halves(cos, sin)
        for local in (range(len(self.bindings)) if blocks is None else blocks):
            binding, j, layer = self.bindings[local], self._signature[local], self.kv_base + local
            q, k, v = self._pre[(phase, j)](x, *ropes[self._local_rope[local]], *binding.pre)
            if batch is not None:
                x = self._post_fn(local, phase, j)(x, batch.attend([self.kv], layer, q, k, v, self.scale), *binding.post)
                continue
            self.kv.append(layer, self.to_array(k), self.to_array(v))
            if attn_out is not None:
                self.kv.attend(layer, self.to_array(q), self.scale, out=attn_out[0])
                attn = attn_out[1]
            else:
                o = self.kv.attend(layer, self.to_array(q), self.scale)      # [S, h_a, D]
                attn = self.from_array(o.reshape(S, self.spec.q_dim))        # [S, h_a, D] -> [S, h_a*D]
            x = self._post_fn(local, phase, j)(x, attn, *binding.post)
        return x

    def forward_batch(self, x, cos, sin, caches: list, rows: list[int], blocks: range | None = None,
                      advance: bool = True):
        """Several sequences in one step: x [S, H], cos/sin [S, D] (each row at its own sequence's position);
        sequence b owns the next rows[b] rows and its own KV cache caches[b]. The compiled functions are
        position-wise, so one call per block serves every row (each weight read once per step for all sequences)
        and only attention runs per sequence, on its own cache.
        rows of 1 each, several sequences: a batched decode step on the decode_b{S} variant, S =
        decode_step_rows(rows, batch_sizes) >= len(rows); rows past the sequences' are padding (no attention,
        no KV; the caller drops their outputs). Each real row's result is bit-identical to its one-token decode.
        Otherwise S = sum(rows) on the prefill variant (any number of rows), or decode for one row.
        blocks / advance: as run_blocks (hybrid decode runs one group at a time and commits the step once every
        group has appended its KV)."""
        S = x.shape[0]
        assert len(caches) == len(rows) and decode_step_rows(rows, self.batch_sizes) == S, (len(caches), rows, S)
        phase = batch_phase(S) if len(rows) > 1 and all(n == 1 for n in rows) else "decode" if S == 1 else "prefill"
        starts = [sum(rows[:b]) for b in range(len(rows))]
        batch = (self._decode_batch_for(caches) or self._gpu_decode_batch_for(caches)) if all(n == 1 for n in rows) \
            else None
        ropes = self.rope_halves(cos, sin)
        for local in (range(len(self.bindings)) if blocks is None else blocks):
            binding, j = self.bindings[local], self._signature[local]
            q, k, v = self._pre[(phase, j)](x, *ropes[self._local_rope[local]], *binding.pre)
            o = self.attend_rows(self.kv_base + local, q, k, v, caches, starts, rows, S, batch)
            x = self._post_fn(local, phase, j)(x, o, *binding.post)
        if advance:
            for kv, n in zip(caches, rows):
                kv.advance(n)
        return x

    def rope_halves(self, cos, sin) -> tuple[tuple, tuple]:
        """((cos, sin) of the global blocks, (cos, sin) of the local ones) as device tensors [S, D]: with a local
        RoPE, the halves of RopeTables' [S, 2D] rows (runtime/rope.rope_half), copied once a step (not per block).
        On the GPU, a decode step's halves (S = 1 or a batched decode size) go into buffers kept per S for the
        session: a captured step (decode graphs, hybrid decode's group graphs, one per step shape) bakes their
        addresses in and replays without calling this, so they must outlive any other step's. The arrays of the
        last (cos, sin) pair of each S are kept too: a decode graph passes the same static pair every step, so a
        captured step only copies: a tensor view made during a capture would invalidate it (runtime/moe_decode_row.py
        says why). Other row counts (prompt chunks) get new halves, captured by nothing."""
        if self.spec.local_rope is None:
            return (cos, sin), (cos, sin)
        D = self.spec.head_dim
        S = cos.shape[0]
        kept = self._rope_split.get(S)
        if kept is None or kept[0] is not cos or kept[1] is not sin:       # held: their ids stay unique
            c, s = self.to_array(cos), self.to_array(sin)
            xp = _array_module(c)
            if xp is np or not (S == 1 or S in self.batch_sizes):
                # the host's tensors are copies of their arrays; a prompt's chunk is not captured: new halves
                return tuple((self.from_array(xp.ascontiguousarray(rope_half(c, local, D))),   # [S, 2D] -> [S, D]
                              self.from_array(xp.ascontiguousarray(rope_half(s, local, D)))) for local in (False, True))
            if kept is None:
                halves = tuple(xp.empty((S, D), c.dtype) for _ in range(4))   # [S, D] each
                kept = (cos, sin, (c, s), halves, tuple(self.from_array(h) for h in halves))
            else:
                kept = (cos, sin, (c, s), kept[3], kept[4])
            self._rope_split[S] = kept
        _, _, (c, s), halves, tensors = kept
        for h, (a, local) in zip(halves, ((c, False), (s, False), (c, True), (s, True))):
            h[...] = rope_half(a, local, D)                                 # [S, 2D] -> [S, D]
        return (tensors[0], tensors[1]), (tensors[2], tensors[3])

    def _post_fn(self, local: int, phase: str, signature: int):
        """The post-attention call of the stage's block `local`: the compiled post_attn, or a MoE block's."""
        return self._moe(phase, signature) if self._moe_layer[local] else self._post[(phase, signature)]

    def attend_rows(self, layer: int, q, k, v, caches: list, starts: list[int], rows: list[int], S: int, batch=None):
        """forward_batch's attention for one block: sequence b's rows starts[b].. append to and attend over
        caches[b]; rows past sum(rows) are padding (zero output). Returns a device tensor [S, h_a*D].
        batch: a kv.cache_cpu.DecodeBatch (one token per sequence, host caches on the compiled kernel), which
        does the same per sequence without the per-call overheads, or a kv.decode_batch_gpu.GpuDecodeBatch (GPU
        caches: one launch for all sequences), which returns None for a step it leaves to the per-sequence path;
        else per-sequence append + attend."""
        if batch is not None:
            o = batch.attend(caches, layer, q, k, v, self.scale)
            if o is not None:
                return o
        q, k, v = self.to_array(q), self.to_array(k), self.to_array(v)
        outs = []
        for kv, a, n in zip(caches, starts, rows):
            kv.append(layer, k[a:a + n], v[a:a + n])
            outs.append(kv.attend(layer, q[a:a + n], self.scale).reshape(n, self.spec.q_dim))  # [n, h_a, D] -> [n, h_a*D]
        if S > sum(rows):                                # padding rows of a batched decode step attend nothing
            outs.append(_array_module(outs[0]).zeros((S - sum(rows), self.spec.q_dim), outs[0].dtype))
        o = outs[0] if len(outs) == 1 else _array_module(outs[0]).concatenate(outs)             # [S, h_a*D]
        return self.from_array(o)

    def _decode_batch_for(self, caches: list):
        """The stage's DecodeBatch when every cache is a host cache on the compiled decode kernel, else None."""
        if self._decode_batch is None:
            from helmc.runtime.kv.cache_cpu import DecodeBatch
            self._decode_batch = DecodeBatch(self.spec.num_heads, self.spec.head_dim)
        return self._decode_batch if self._decode_batch.applies(caches, self.spec.q_dim) else None

    def _gpu_decode_batch_for(self, caches: list):
        """The stage's GpuDecodeBatch when every cache is a GPU cache whose cubin has the batched decode kernel,
        else None. Only batched steps take it: one sequence's decode keeps its cache's path (its captured graph)."""
        from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
        if not GpuDecodeBatch.applies(caches, self.spec.q_dim):
            return None
        return self.shared_gpu_decode_batch()

    def shared_gpu_decode_batch(self):
        """This stage's GpuDecodeBatch, made on first use. Stages over one set of GPU caches (a hybrid plan's
        streamed groups and its resident blocks) share it: its per-step table of every GPU-cache layer is then
        built once a step, not once per stage (at batch 8, 12 streamed groups + the resident part: 13 builds of
        [L, B, fields], each B x L Python rows and an upload, before the sharing)."""
        if self._gpu_decode_batch is None:
            from helmc.runtime.kv.decode_batch_gpu import GpuDecodeBatch
            self._gpu_decode_batch = GpuDecodeBatch(self.spec.num_heads, self.spec.head_dim, self.to_array,
                                                    self.from_array)
        return self._gpu_decode_batch


def _array_module(a):
    """NumPy for host arrays, CuPy for device ones (imported only when a GPU stage hands us its arrays)."""
    if type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    import numpy
    return numpy

