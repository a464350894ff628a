"""Prefill of the CPU-stage blocks on the GPU, their weights streamed over PCIe (plan.placement.prefill_on_gpu).

A prompt of S tokens through a CPU block costs the CPU 2 S W_param FLOPs: for a Qwen3-8B block and
S = 128 that is 49 GFLOP, tens of milliseconds even with AVX-512. The GPU does the same work in about
a millisecond, and the block's weights cross PCIe once per prompt (W_param / B_link: ~7 ms for 386 MB
at 55 GB/s). So when the plan leaves VRAM for one block's weights, the prompt runs there:

  * the CPU stage keeps its weights in pinned host memory, one arena per block (`PinnedBlockArena`);
    its TVM tensors are views of the arena, so decode on the CPU reads the same bytes;
  * a VRAM arena with the same layout receives a whole block in one DMA, and the GPU stage's
    compiled pre_attn/post_attn prefill functions run with tensors viewing it;
  * blocks go in order, layer-major: one block runs every chunk of the prompt before the next block's
    weights come, so each block crosses once. K, V of the block go to a contiguous VRAM scratch
    [2, h_kv, S, d] that causal attention reads, then to the CPU stage's KV cache on the host, where
    decode attends them.
The KV cache of the CPU blocks must be empty (a new request): the scratch holds only this prompt's keys.
The VRAM arena, the scratch and the prompt's hidden state live in the GPU stage's KV page pool while it
is still empty (KVCacheGPU.lend_empty_pool; the plan sizes the pool for them), so the streamed prefill
costs the decode no VRAM; the hidden state goes back to the host before the GPU stage writes any page.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec

from helmc.runtime.kv.paged_attention import attend_blocks, contiguous_blocks
from helmc.runtime.kv.sinks import checked_sinks, sinks_of_layer
from helmc.runtime.progress import steps
from helmc.runtime.rope import block_rope
from helmc.runtime.weights.safetensors_mmap import Checkpoint
from helmc.runtime.stage import StageBinding, block_function_name
from helmc.runtime.weights.bind import release_block, weight_view

ARENA_ALIGN = 256                       # TVM and DLPack want aligned tensor data; 256 also suits DMA
_NUMPY_OF = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16, "uint8": np.uint8}


@dataclass(frozen=True)
class ArenaSlot:
    name: str
    dtype: str                          # the compiled function's: bfloat16 travels as uint16 bits, quantized as uint8
    shape: tuple[int, ...]
    offset: int                         # bytes from the arena start, a multiple of ARENA_ALIGN
    nbytes: int


def block_views(ck, spec: ModelSpec, layer: int) -> list[tuple[str, np.ndarray, str]]:
    """(name, host array, dtype) of one block's weights as its compiled functions take them, in their order
    (pre_attn's, then post_attn's): quantized weights as raw blocks (weights.bind.weight_view)."""
    shapes = spec.block_weight_shapes()
    return [(name, *weight_view(ck, f"model.layers.{layer}.{name}", shapes[name], spec.weight_type(layer, name),
                                spec.dtype))
            for name in (*spec.pre_attn_weight_names(), *spec.post_attn_weight_names())]


def arena_layout(views: list[tuple[str, np.ndarray, str]]) -> tuple[tuple[ArenaSlot, ...], int]:
    """Slots of one block's weights (block_views) and the arena size. Blocks of one type signature
    (ModelSpec.block_signatures) share a layout."""
    slots, off = [], 0
    for name, array, dt in views:
        slots.append(ArenaSlot(name, dt, tuple(array.shape), off, array.nbytes))
        off += aligned_bytes(array.nbytes)
    return tuple(slots), off


def slot_views(buf, slots: tuple[ArenaSlot, ...]):
    """Typed views [*shape] of a flat uint8 buffer (NumPy or CuPy), one per slot."""
    return [buf[s.offset:s.offset + s.nbytes].view(_NUMPY_OF[s.dtype]).reshape(s.shape) for s in slots]


def binding_of(tensors: list, spec: ModelSpec) -> StageBinding:
    n_pre = len(spec.pre_attn_weight_names())
    return StageBinding(pre=tensors[:n_pre], post=tensors[n_pre:])


class PinnedBlockArena:
    """One CPU block's weights in page-locked host memory, as TVM CPU tensors over it.

    Invariant: `host` is pinned and never reallocated, so a DMA may read it while the CPU computes."""

    def __init__(self, views: list, spec: ModelSpec, layer: int):
        import cupyx
        import tvm.runtime

        slots, nbytes = arena_layout(views)
        self.layer, self.slots, self.nbytes = layer, slots, nbytes
        from helmc.runtime.memory.allocation import allocate
        self.host = allocate("pinned", nbytes, lambda: cupyx.empty_pinned((nbytes,), np.uint8), f"block {layer}'s weights")
        tensors = []
        for s, view, (_, src, _) in zip(slots, slot_views(self.host, slots), views):
            np.copyto(view, src.view(view.dtype) if src.dtype != view.dtype else src)
            t = tvm.runtime.from_dlpack(view)
            tensors.append(t._create_view(s.shape, "bfloat16") if s.dtype == "bfloat16" else t)
        self.binding = binding_of(tensors, spec)


def bind_pinned_layers(ck: Checkpoint, spec: ModelSpec, layers: range, progress=lambda m: None):
    """CPU-stage weights of `layers` in pinned arenas: (bindings for the CPU stage, arenas)."""
    arenas = []
    with steps(progress, f"pinning the weights of {len(layers)} CPU blocks (streamed to the GPU for prefill)",
               len(layers)) as bar:
        for i in layers:
            arenas.append(PinnedBlockArena(block_views(ck, spec, i), spec, i))
            release_block(ck, spec, i)                             # copied into the arena: one copy in RAM
            bar.advance()
    return [a.binding for a in arenas], arenas


def prompt_buffer_sizes(S: int, hidden: int, num_kv_heads: int, head_dim: int,
                        rope_width: int | None = None) -> tuple[int, int, int, int]:
    """Bytes of the prompt's buffers while one CPU block runs every chunk on the GPU: the hidden state
    [S, H] fp16, the block's K and V [2, h_kv, S, d] fp16 that causal attention reads, and RoPE's cos
    and sin [S, W] fp32 each (W = rope_width, default d; a local RoPE's rows hold both tables, 2d). The cost
    model plans the same buffers (cost_model.prefill_prompt_bytes)."""
    W = head_dim if rope_width is None else rope_width
    return S * hidden * 2, 2 * num_kv_heads * S * head_dim * 2, S * W * 4, S * W * 4


class StreamedPrefill:
    """Runs the prompt through the CPU stage's blocks on the GPU (see the module docstring).

    VRAM: one block's weights, the prompt's hidden state [S, H] and K, V [2, h_kv, S, d] (fp16) and
    cos, sin [S, W] (fp32, W = ModelSpec.rope_width), held only while run() runs: borrowed from the GPU stage's empty KV page
    pool through `lend(nbytes)` when it is big enough (the plan sizes the pool for it), else allocated.
    lend_arena(nbytes), where given, lends the block's weights apart (a hybrid plan's idle staging ring of at
    least one block, runtime/hybrid/load.ring_lender): `lend` is then asked for the prompt's buffers only.
    sinks: per arena, its block's attention sinks (weights.bind.layer_sinks of the arenas' layers), or None; kept on
    the device once and given to each chunk's attention."""

    def __init__(self, vm, spec: ModelSpec, arenas: list[PinnedBlockArena], cpu_kv, chunk_tokens: int,
                 cupy_to_tvm, tvm_to_cupy, score_budget_bytes: int = 32 << 20, block_tokens: int = 4096,
                 lend=None, kv_targets: tuple[tuple[str, int], ...] | None = None, ops=None, lend_arena=None,
                 sinks=None):
        import cupy as cp

        if not arenas:
            raise HelmcError("StreamedPrefill: expected the CPU stage's pinned block arenas, found none")
        if chunk_tokens < 1:
            raise HelmcError(f"StreamedPrefill: chunk_tokens expected >= 1, found {chunk_tokens}")
        self.cp, self.spec, self.arenas, self.cpu_kv = cp, spec, arenas, cpu_kv
        self.chunk = chunk_tokens
        self.to_tvm, self.to_cupy = cupy_to_tvm, tvm_to_cupy
        self.scale = spec.attention_scale
        self.score_budget_bytes, self.block_tokens = score_budget_bytes, block_tokens
        # Per type signature (one for unquantized models): its prefill functions.
        self.fns = {j: (vm[block_function_name("pre_attn", "prefill", j)], vm[block_function_name("post_attn", "prefill", j)])
                    for j in {spec.signature_index(a.layer) for a in arenas}}
        self.lend, self.lend_arena = lend, lend_arena
        # The bundle's tensor-core attention (runtime/kv/cuda_ops.CudaOps.flash_prefill) when its cubin has it:
        # one kernel per chunk and block over the scratch's rows where attend_blocks runs fp32 score tiles.
        self.flash = ops if ops is not None and ops.has_flash(spec.head_dim, spec.group_size) else None
        # Where each arena's K, V go: ("cpu", i), layer i of the CPU cache (a plain split: every arena), or
        # ("gpu", i), layer i of the GPU cache (hybrid decode's streamed blocks: their rows wait on the host in
        # gpu_rows until the loan of the GPU pool ends; the caller appends them, take_gpu_rows).
        self.kv_targets = kv_targets or tuple(("cpu", n) for n in range(len(arenas)))
        if len(self.kv_targets) != len(arenas) or {t for t, _ in self.kv_targets} - {"cpu", "gpu"}:
            raise HelmcError(f"StreamedPrefill: expected a ('cpu' | 'gpu', layer) target per arena, found "
                             f"{self.kv_targets} for {len(arenas)} arenas")
        checked = checked_sinks(sinks, len(arenas), spec.num_kv_heads, "StreamedPrefill")
        self.sinks = None if checked is None else tuple(cp.asarray(s) for s in checked)   # per arena, on the device
        self.gpu_rows: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []     # per prompt of the last run
        self.bytes_streamed = 0
        self.borrowed = None            # whether the last run() used the KV pool's VRAM

    def buffer_bytes(self, S: "int | list[int]") -> int:
        """VRAM one run() over S tokens (or run_sequences over prompts of S[b] tokens) asks `lend` for: each
        prompt's buffers and, unless lend_arena lends it, the block arena, each ARENA_ALIGN-aligned."""
        arena = 0 if self.lend_arena is not None else self.arena_bytes
        return streamed_prefill_bytes(arena, S, self.spec)

    @property
    def arena_bytes(self) -> int:
        return max(a.nbytes for a in self.arenas)

    def run(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [S, H], cos/sin [S, W] (W = ModelSpec.rope_width) on the host -> x after every CPU block, [S, H] fp16 on the host;
        K, V land in the CPU KV cache. Returns to the host because the VRAM may be the KV pool's."""
        return self.run_sequences([(x, cos, sin)], [self.cpu_kv], self.lend)[0]

    def run_sequences(self, prompts: list, kvs: list, lend=None) -> list[np.ndarray]:
        """Several new requests' prompts through the CPU blocks at once (runtime/serve/batch_model.py): prompts
        [(x [S_b, H], cos/sin [S_b, W])] on the host, kvs[b] their (empty) CPU-stage KV caches. Each block's
        weights cross PCIe once for all of them; within a block each prompt runs its own chunks on its own
        buffers exactly as run() runs it alone, so its rows and K, V are bit-identical to that. lend(nbytes):
        a flat uint8 VRAM buffer of nbytes or None (then allocated). -> x [S_b, H] fp16 on the host each."""
        cp = self.cp
        if len(prompts) != len(kvs) or not prompts:
            raise HelmcError(f"streamed prefill: expected a KV cache per prompt, found {len(kvs)} for {len(prompts)}")
        for kv in kvs:
            if kv.length != 0:
                raise HelmcError(f"streamed prefill: expected an empty CPU-stage KV cache, found {kv.length} tokens")
        lengths = [x.shape[0] for x, _, _ in prompts]
        H, h_kv, d, W = self.spec.hidden_size, self.spec.num_kv_heads, self.spec.head_dim, self.spec.rope_width
        total = self.buffer_bytes(lengths)
        buf = lend(total) if lend is not None else None
        self.borrowed = buf is not None
        if buf is None:
            buf = cp.empty((total,), cp.uint8)
        if self.lend_arena is not None:
            device, off = self.lend_arena(self.arena_bytes), 0
            assert device is not None, ("lend_arena lends at least one block", self.arena_bytes)
        else:
            device, off = buf[:self.arena_bytes], aligned_bytes(self.arena_bytes)
        seqs = []                        # per prompt: x, K/V scratch, cos, sin on the device
        for (x, cos, sin), S in zip(prompts, lengths):
            parts = []
            for n in prompt_buffer_sizes(S, H, h_kv, d, W):
                parts.append(buf[off:off + n])
                off += aligned_bytes(n)
            xb, kvb, cb, sb = parts
            xg = xb.view(cp.float16).reshape(S, H)                          # [S*H*2 bytes] -> [S, H]
            scratch = kvb.view(cp.float16).reshape(2, h_kv, S, d)          # this block's K, V of the whole prompt
            cos_g = cb.view(cp.float32).reshape(S, W)                      # [S*W*4 bytes] -> [S, W]
            sin_g = sb.view(cp.float32).reshape(S, W)                      # [S*W*4 bytes] -> [S, W]
            xg.set(np.ascontiguousarray(x, np.float16))
            cos_g.set(np.ascontiguousarray(cos, np.float32))
            sin_g.set(np.ascontiguousarray(sin, np.float32))
            seqs.append((xg, scratch, cos_g, sin_g))
        self.gpu_rows = [{} for _ in prompts]
        bindings = {}            # one per arena layout (type signature), all over the same device buffer
        for a in self.arenas:
            if a.slots not in bindings:
                bindings[a.slots] = binding_of([self.to_tvm(v, "bfloat16" if sl.dtype == "bfloat16" else None)
                                              for sl, v in zip(a.slots, slot_views(device, a.slots))], self.spec)
        stream = cp.cuda.get_current_stream()
        for local, arena in enumerate(self.arenas):
            # Same stream as the kernels: the copy waits for the previous block's last reader of the arena.
            cp.cuda.runtime.memcpyAsync(device.data.ptr, arena.host.ctypes.data, arena.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            self.bytes_streamed += arena.nbytes
            fns = self.fns[self.spec.signature_index(arena.layer)]
            where, layer = self.kv_targets[local]
            sinks = sinks_of_layer(self.sinks, local, self.spec.num_heads, "StreamedPrefill")
            for (xg, scratch, cos_g, sin_g), kv, S, gpu_rows in zip(seqs, kvs, lengths, self.gpu_rows):
                for c0 in range(0, S, self.chunk):
                    c1 = min(S, c0 + self.chunk)
                    xg[c0:c1] = self._chunk(xg[c0:c1], *block_rope(self.spec, arena.layer, cos_g[c0:c1],
                                                                   sin_g[c0:c1]), scratch, c0,
                                            bindings[arena.slots], fns, self.spec.layer_window(arena.layer), sinks)
                rows = scratch.get()                                        # [2, h_kv, S, d] fp16 on the host
                k_rows, v_rows = rows[0].transpose(1, 0, 2), rows[1].transpose(1, 0, 2)   # [h_kv,S,d] -> [S,h_kv,d]
                if where == "cpu":
                    kv.append(layer, k_rows, v_rows)
                else:
                    gpu_rows[layer] = (np.ascontiguousarray(k_rows), np.ascontiguousarray(v_rows))
        for kv, S in zip(kvs, lengths):
            kv.advance(S)
        return [xg.get() for xg, _, _, _ in seqs]                          # synchronous: the loan ends here

    def take_gpu_rows(self) -> list[dict[int, tuple[np.ndarray, np.ndarray]]]:
        """The last run's K, V rows [S_b, h_kv, d] of the arenas whose target is the GPU cache, per prompt, by its
        layer index (handed over once: the caller appends them chunk by chunk beside the resident blocks' own)."""
        rows, self.gpu_rows = self.gpu_rows, []
        return rows

    def _chunk(self, x, cos, sin, scratch, c0: int, binding: StageBinding, fns, window: int, sinks=None):
        """Rows c0.. of the prompt through one block: cos / sin [n, d] its RoPE table's (runtime/rope.block_rope),
        window its attention window (ModelSpec.layer_window, 0: global), sinks its attention sinks on the device (or
        None), as the resident stage gives that block."""
        cp, n = self.cp, x.shape[0]
        pre, post = fns
        to_tvm, to_cupy = self.to_tvm, self.to_cupy
        xt = to_tvm(cp.ascontiguousarray(x))
        q, k, v = pre(xt, to_tvm(cp.ascontiguousarray(cos)), to_tvm(cp.ascontiguousarray(sin)), *binding.pre)
        h_kv, d = self.spec.num_kv_heads, self.spec.head_dim
        scratch[0, :, c0:c0 + n] = to_cupy(k).reshape(n, h_kv, d).transpose(1, 0, 2)   # [n, h_kv*d] -> [h_kv, n, d]
        scratch[1, :, c0:c0 + n] = to_cupy(v).reshape(n, h_kv, d).transpose(1, 0, 2)   # [n, h_kv*d] -> [h_kv, n, d]
        qc = to_cupy(q).reshape(n, self.spec.num_heads, d)                              # [n, h_a*d] -> [n, h_a, d]
        if self.flash is not None and qc.dtype == cp.float16:
            o = cp.empty(qc.shape, cp.float16)                                          # [n, h_a, d]
            self.flash.flash_prefill(cp.ascontiguousarray(qc), scratch[0], scratch[1], c0 + n, c0, h_kv, window,
                                     self.scale, o, sinks=sinks)
        else:
            blocks = contiguous_blocks(scratch[0, :, :c0 + n], scratch[1, :, :c0 + n], 0, self.block_tokens)
            o = attend_blocks(cp, qc, c0, blocks, h_kv, self.scale, window, np.float32, self.score_budget_bytes,
                              sinks=sinks)
        attn = to_tvm(cp.ascontiguousarray(o.reshape(n, self.spec.q_dim)))              # [n, h_a, d] -> [n, h_a*d]
        return to_cupy(post(xt, attn, *binding.post))


def aligned_bytes(n: int) -> int:
    """n rounded up to ARENA_ALIGN: what each buffer of the streamed prefill's one allocation takes."""
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def streamed_prefill_bytes(arena_bytes: int, prompt_tokens: "int | list[int]", spec: ModelSpec) -> int:
    """VRAM a StreamedPrefill run over one prompt of `prompt_tokens` (or prompts of prompt_tokens[b] tokens
    each) asks its lender for: the block arena and each prompt's buffers, each ARENA_ALIGN-aligned in the one
    buffer."""
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    return aligned_bytes(arena_bytes) + sum(
        aligned_bytes(n) for S in lengths
        for n in prompt_buffer_sizes(S, spec.hidden_size, spec.num_kv_heads, spec.head_dim, spec.rope_width))
