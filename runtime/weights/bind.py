"""Binding checkpoint tensors to the compiled functions' weight parameters.

Weights go from the mmapped safetensors to their device tensor one at a time: the NumPy view is a
window on the page cache and the only resident copy is the device tensor, so loading never holds a
second full copy of the model (DEVELOPERS.md).
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from helmc.model.spec import ModelSpec

from helmc.errors import HelmcError
from helmc.runtime.progress import steps
from helmc.runtime.stage import StageBinding
from helmc.runtime.weights.safetensors_mmap import Checkpoint


def open_checkpoint(path: str, spec: ModelSpec | None = None):
    """The bundle's weights: a GGUF file (GGUFCheckpoint, checked against `spec`) or a directory of safetensors."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        from helmc.runtime.weights.gguf_mmap import GGUFCheckpoint
        return GGUFCheckpoint(path, spec)
    return Checkpoint.for_spec(path, spec) if spec is not None else Checkpoint(path)


def check_checkpoint(ck, spec: ModelSpec) -> None:
    """Every tensor the plan will read exists with the shape config.json implies, and nothing else is there
    (a tensor the model does not have means config.json and the weights describe different models), before
    any loading. Harmless extras transformers also ignores are allowed: RoPE's inv_freq buffers of older
    checkpoints, and an lm_head.weight beside tied embeddings."""
    expected = expected_tensors(spec)
    for name, shape in expected.items():
        found = tuple(ck.info(name).shape)
        if found != tuple(shape):
            raise HelmcError(f"weights: {name} shape expected {list(shape)}, found {list(found)}")
    if isinstance(ck, Checkpoint):          # a GGUF file's tensors are checked when it is opened (gguf_spec)
        extra = [n for n in ck.where if n not in expected and not n.endswith("rotary_emb.inv_freq")
                 and not (n == "lm_head.weight" and spec.tie_word_embeddings)]
        if extra:
            raise HelmcError(f"weights: expected only the tensors of this {spec.architecture} ({spec.num_layers} blocks, "
                             f"qkv_bias={spec.qkv_bias}, tied embeddings={spec.tie_word_embeddings}), found "
                             f"{len(extra)} more: {sorted(extra)[:3]} (config.json and the weights disagree)")


def weight_view(ck, name: str, shape: tuple[int, ...], qtype: str, dtype: str) -> tuple[np.ndarray, str]:
    """(array, dtype) of one tensor as the compiled functions take it: a quantized weight's raw blocks
    (uint8 [rows, row bytes], HF row order), or a float tensor in the model's dtype. Float tensors stored in
    another float type (a GGUF keeps norms in F32) are converted, a copy of that one small tensor."""
    if qtype:
        if ck.info(name).type != qtype:
            raise HelmcError(f"weights: {name} expected {qtype} (what the bundle was built for), found {ck.info(name).type}")
        return ck.raw_hf(name), "uint8"
    view, stored = ck.view(name, shape), ck.info(name).dtype
    if stored == dtype:
        return view, dtype
    if stored not in ("float32", "float16", "bfloat16"):
        raise HelmcError(f"weights: {name} expected a float tensor, found {stored}")
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, float32_from_bf16_bits
    values = float32_from_bf16_bits(view) if stored == "bfloat16" else np.asarray(view, dtype=np.float32)
    return (bf16_bits_from_float32(values) if dtype == "bfloat16" else values.astype(dtype)), dtype

def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    for i in range(spec.num_layers):
        for name, shape in spec.block_weight_shapes(i).items():
            out[f"model.layers.{i}.{name}"] = shape
    return out


def tensor_to_device(view: np.ndarray, dtype: str, dev):
    """One checkpoint tensor onto a TVM device; bf16 arrives as uint16 raw bits."""
    import tvm.runtime
    from helmc.runtime.memory.allocation import allocate
    if dtype == "bfloat16":
        from helmc.runtime.tvm_tensors import tensor_from_numpy
        return allocate("weights", view.nbytes, lambda: tensor_from_numpy(view, "bfloat16", dev))
    return allocate("weights", view.nbytes, lambda: tvm.runtime.tensor(np.ascontiguousarray(view), dev))


def bind_layers(ck: Checkpoint, spec: ModelSpec, layers: range, dev,
                progress: Callable[[str], None] = lambda m: None,
                to_device: Callable = tensor_to_device, experts_on=None,
                experts_in_vram: tuple[tuple[int, ...], ...] = (), expert_cache=None) -> list[StageBinding]:
    """Each block's weights on `dev` through to_device; a MoE block's routed experts on experts_on = (device,
    to_device) where given (a GPU stage's blocks keep their experts in host RAM: runtime/moe_gpu.py), except
    those experts_in_vram lists for the block (Plan.placement.gpu_experts), which go to `dev` with the rest.
    expert_cache (moe_expert_cache.ExpertCacheOptions, or None: off): a block with some but not all of its quantized
    experts in VRAM gets an ExpertResidency over those slots, and every expert's host rows."""
    expert_dev, expert_to = experts_on or (dev, to_device)
    out = []
    with steps(progress, f"binding the weights of {len(layers)} blocks", len(layers)) as bar:
        for i in layers:
            shapes = spec.block_weight_shapes(i)

            def load(name, dev=dev, to_device=to_device):
                return to_device(*weight_view(ck, f"model.layers.{i}.{name}", shapes[name],
                                              spec.weight_type(i, name), spec.dtype), dev)
            post = [load(w) for w in spec.post_attn_weight_names(i)]
            if spec.is_moe_layer(i):            # the experts: one argument after post_moe's weights (moe_experts.py)
                vram = frozenset(experts_in_vram[i]) if experts_in_vram and experts_on else frozenset()
                post.append(_bind_experts(spec, i, load, vram, (dev, to_device), (expert_dev, expert_to),
                                          expert_cache))
            out.append(StageBinding(pre=[load(w) for w in spec.pre_attn_weight_names()], post=post))
            release_block(ck, spec, i)          # copied (to_device returns once it has read each view): one copy
            bar.advance()
    return out


def _bind_experts(spec: ModelSpec, layer: int, load: Callable, vram: frozenset, device, host, cache=None):
    """Block `layer`'s routed experts: those in `vram` each on the stage's device, the others on `host`. Quantized
    experts on the CPU go into one tensor per kind [experts * rows, row bytes] (GGUF's stacked layout, which the
    CPU's one-call expert sum reads), each expert a view into it; an expert in VRAM leaves its rows there unset
    (never written, never resident), unless the VRAM expert cache (`cache`) may send it back."""
    from helmc.runtime.moe_experts import LayerExperts
    moe = spec.moe
    names = [moe.expert_weight_names(e) for e in range(moe.num_experts)]

    def raw(name):
        return load(name, None, lambda view, dtype, dev: view)      # the checkpoint's uint8 view, not copied
    stacked = None
    # biased experts (gpt-oss): their VRAM biases are stacked by slot at load (vram_biases), which the cache's
    # copies do not move: no cache for them
    cached = cache is not None and cache.enabled and 0 < len(vram) < moe.num_experts and not moe.expert_bias
    if all(spec.weight_type(layer, n) for n in names[0]) and host[0].dlpack_device_type() == 1:   # kDLCPU
        unset = frozenset() if cached else vram          # the cache may send any expert back to the host
        stacked = tuple(_stacked(raw, [names[e][kind] for e in range(moe.num_experts)], unset) for kind in range(3))
    if stacked is not None and None not in stacked:
        order = sorted(vram)
        in_vram = _stacked_vram(raw, names, order, device[0])
        slot = {e: i for i, e in enumerate(order)}

        def weights_of(e):            # the stacked weights' views, then the biases (gpt-oss), each its own tensor
            biases = tuple(load(n, *(device if e in vram else host)) for n in moe.expert_bias_names(e))
            if e not in vram:
                return tuple(views[e] for _, views in stacked) + biases
            if in_vram:
                return tuple(views[slot[e]] for _, views in in_vram) + biases
            return tuple(load(n, *device) for n in names[e]) + biases
        return LayerExperts(tuple(weights_of(e) for e in range(moe.num_experts)), spec.expert_signature_index(layer),
                            vram, tuple(whole for whole, _ in stacked) + _stacked_biases(load, spec, host[0]),
                            tuple(whole for whole, _ in in_vram) if in_vram else None, tuple(order),
                            _vram_biases(load, spec, order, device[0]) if in_vram else (), layer,
                            **(_cache_fields(moe.num_experts, order, stacked, in_vram, cache) if cached and in_vram
                               else {}))
    experts = tuple(tuple(load(n, *(device if e in vram else host)) for n in moe.expert_param_names(e))
                    for e in range(moe.num_experts))
    return LayerExperts(experts, spec.expert_signature_index(layer), vram, layer=layer)


def _cache_fields(num_experts: int, order: list[int], stacked, in_vram, cache) -> dict:
    """LayerExperts' fields of a block under the VRAM expert cache: its residency (the slots start as `order`),
    every slot's VRAM views and every expert's host views."""
    from helmc.runtime.moe_expert_cache import ExpertResidency
    return dict(residency=ExpertResidency(num_experts, order, cache),
                vram_slots=tuple(tuple(views[s] for _, views in in_vram) for s in range(len(order))),
                host_views=tuple(tuple(views[e] for _, views in stacked) for e in range(num_experts)))


def _stacked_biases(load: Callable, spec: ModelSpec, dev) -> tuple:
    """gpt-oss's expert biases for the CPU's biased one-call sums: per kind (gate, up, down) one fp32 tensor
    [experts, rows] on `dev` (the host); () for experts without biases."""
    import tvm.runtime
    return tuple(tvm.runtime.tensor(rows, dev) for rows in _bias_stacks(load, spec, range(spec.moe.num_experts)))


def _vram_biases(load: Callable, spec: ModelSpec, order: list[int], dev) -> tuple:
    """gpt-oss's biases of the experts in VRAM for the GPU's biased expert kernels: per kind (gate, up, down) one
    fp32 device tensor [slots, rows], expert order[slot] at slot (as _stacked_vram's weights), made once at load
    (CUDA graphs capture the pointers); () for experts without biases."""
    stacks = _bias_stacks(load, spec, order)
    if not stacks:
        return ()
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm
    from helmc.runtime.memory.allocation import allocate
    out = []
    for rows in stacks:
        with cp.cuda.Device(dev.index):
            out.append(cupy_to_tvm(allocate("weights", rows.nbytes, lambda: cp.asarray(rows))))
    return tuple(out)


def _bias_stacks(load: Callable, spec: ModelSpec, experts) -> tuple[np.ndarray, ...]:
    """gpt-oss's biases of `experts`, in that order: per kind (gate, up, down) one fp32 array [len(experts), rows];
    () for experts without biases."""
    if not spec.moe.expert_bias:
        return ()
    names = [spec.moe.expert_bias_names(e) for e in experts]
    return tuple(np.stack([_f32_bias(load, n[kind]) for n in names]) for kind in range(3))     # [experts, rows]


def _f32_bias(load: Callable, name: str) -> np.ndarray:
    """An expert bias from the checkpoint as fp32 (bf16 bits widened)."""
    from helmc.runtime.tvm_tensors import float32_from_bf16_bits
    view, dtype = load(name, None, lambda view, dtype, _dev: (view, dtype))
    return float32_from_bf16_bits(view) if dtype == "bfloat16" else np.asarray(view, np.float32)


def _stacked(raw: Callable, names: list[str], vram: frozenset) -> tuple | None:
    """(one host tensor [experts * rows, row bytes], each expert's tensor over its rows) of quantized expert
    weights, each expert not in `vram` copied into its rows straight from the checkpoint's view. The memory is
    NumPy's, 64-byte aligned, each expert's tensor a DLPack view with its own data pointer (compiled functions take
    no byte offset); None where an expert's bytes are not a multiple of 64 (its successor's rows would not be
    aligned)."""
    import tvm.runtime

    from helmc.runtime.memory.allocation import allocate
    rows, row_bytes = raw(names[0]).shape
    if rows * row_bytes % 64:
        return None
    nbytes = rows * row_bytes * len(names)
    buf = allocate("weights", rows * row_bytes * (len(names) - len(vram)), lambda: np.empty(nbytes + 64, np.uint8))
    start = -buf.ctypes.data % 64
    whole = buf[start:start + nbytes].reshape(len(names) * rows, row_bytes)   # [experts * rows, row bytes]
    for e, name in enumerate(names):
        if e not in vram:
            whole[e * rows:(e + 1) * rows] = raw(name)
    return (tvm.runtime.from_dlpack(whole),
            [tvm.runtime.from_dlpack(whole[e * rows:(e + 1) * rows]) for e in range(len(names))])


def _stacked_vram(raw: Callable, names: list, order: list[int], dev) -> tuple | None:
    """The experts in VRAM of a GPU stage's block, quantized: per kind (gate, up, down), (one device tensor
    [len(order) * rows, row bytes], each expert's tensor over its rows), expert order[slot] at slot, read by the
    GPU's two-launch expert kernels (runtime/moe_gpu.py); None on a CPU device, with no expert in VRAM, or where
    an expert's bytes are not a multiple of 16 (the kernels' alignment)."""
    if not order or dev.dlpack_device_type() != 2:          # kDLCUDA
        return None
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm
    from helmc.runtime.memory.allocation import allocate
    out = []
    for kind in range(3):
        rows, row_bytes = raw(names[order[0]][kind]).shape
        if rows * row_bytes % 16:
            return None
        with cp.cuda.Device(dev.index):
            whole = allocate("weights", rows * row_bytes * len(order),
                             lambda: cp.empty((len(order) * rows, row_bytes), cp.uint8))   # [slots * rows, row bytes]
            for slot, e in enumerate(order):
                whole[slot * rows:(slot + 1) * rows].set(np.ascontiguousarray(raw(names[e][kind])))
        out.append((cupy_to_tvm(whole), [cupy_to_tvm(whole[s * rows:(s + 1) * rows]) for s in range(len(order))]))
    return tuple(out)


def layer_sinks(ck, spec: ModelSpec, layers) -> tuple[np.ndarray, ...] | None:
    """Each of `layers`' attention sinks (self_attn.sinks: a logit per query head, fp32, read by the KV caches),
    or None for a model without them."""
    if not spec.attn_sinks:
        return None
    return tuple(weight_view(ck, f"model.layers.{i}.self_attn.sinks", (spec.num_heads,), "", "float32")[0]
                 .astype(np.float32) for i in layers)


def release_block(ck, spec: ModelSpec, layer: int) -> None:
    """Once block `layer`'s weights are copied into memory of the runtime's own: their file pages go
    (weights/page_release.py)."""
    for name in spec.block_weight_shapes(layer):
        ck.release(f"model.layers.{layer}.{name}")


def bind_head(ck: Checkpoint, spec: ModelSpec, dev, to_device: Callable = tensor_to_device) -> list:
    norm, lm = spec.head_weight_names()
    out = [to_device(*weight_view(ck, norm, (spec.hidden_size,), "", spec.dtype), dev),
           to_device(*weight_view(ck, lm, (spec.vocab_size, spec.hidden_size), spec.head_type, spec.dtype), dev)]
    ck.release(lm)                              # a tied head's pages are the embedding's: its rows fault back in
    return out


class Embedding:
    """The token embedding's rows for a step's ids, float32 [S, H]: only those S rows are read from the mmapped
    checkpoint; bf16 rows are widened, quantized rows dequantized (by the gguf package's own code). native: fp16
    rows stay fp16 (a session whose every block runs on the GPU: the device converts what it needs, and NumPy's
    fp16 -> fp32 widening of a prompt's rows cost ~2 ms of its TTFT)."""

    NAME = "model.embed_tokens.weight"

    def __init__(self, ck, spec: ModelSpec, native: bool = False):
        self.qtype, self.hidden, self.native = spec.embed_type, spec.hidden_size, native
        self.table = ck.raw(self.NAME) if self.qtype else ck.view(self.NAME, (spec.vocab_size, spec.hidden_size))
        self.bf16 = not self.qtype and ck.info(self.NAME).dtype == "bfloat16"
        self.scale = spec.embed_scale             # Gemma: sqrt(hidden_size), rounded to the weights' dtype as HF does

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        rows = self.table[ids]                                    # [S, H] (or [S, row bytes] quantized)
        if self.qtype:
            from helmc.runtime.weights.gguf_mmap import dequantize_rows
            rows = dequantize_rows(rows, self.qtype, self.hidden)  # [S, row bytes] -> [S, H]
            return rows * np.float32(self.scale) if self.scale != 1.0 else rows
        if self.bf16:
            from helmc.runtime.tvm_tensors import bf16_bits_from_float32, float32_from_bf16_bits
            rows = float32_from_bf16_bits(rows)
            if self.scale != 1.0:          # bf16 x bf16 is exact in fp32; the product rounds to bf16
                rows = float32_from_bf16_bits(bf16_bits_from_float32(
                    rows * float32_from_bf16_bits(bf16_bits_from_float32(np.float32([self.scale])))))
        elif self.scale != 1.0:
            rows = rows * rows.dtype.type(np.float32(self.scale))   # in the weights' dtype (fp16 rounds there)
        if self.native and rows.dtype == np.float16:
            return np.ascontiguousarray(rows)
        return np.ascontiguousarray(rows, dtype=np.float32)
