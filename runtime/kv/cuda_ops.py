"""The device operations KVCacheGPU uses, on CuPy: buffers, streams, events, copies, and the paged decode
attention kernels (their source and what they compute: schedules/gpu/paged_attention.py).

Attention sinks: the methods that write an attention output take `sinks`, a device [h_a] fp32 array of the layer's
sink logits (made once, so a captured graph keeps its address), or None (the kernels' null: no sinks).
The kernels come prebuilt from the bundle (`paged_attention.cubin`, compiled by `helmc build` for the model's
head_dim and query group and the GPU's arch); nothing is compiled at run time.
CuPy is imported only when CudaOps is built, so this module imports on machines without it.
"""
from __future__ import annotations

import os

import numpy as np

from helmc.errors import HelmcError

H2D, D2H, D2D = 1, 2, 3          # cudaMemcpyKind
# prefill_causal's warp walks every key of its row, O(S) per row: longer fresh prompts go to attend_blocks' tiles
PREFILL_MAX_TOKENS = 4096
WARPS = 4                        # = schedules/gpu/paged_attention.WARPS, the block size the cubin was built for
PAGED_ATTENTION_CUBIN = "paged_attention.cubin"
_KERNEL_NAMES = ("paged_decode_partial", "paged_decode_merge", "paged_append_decode", "prefill_causal")
# schedules/gpu/flash_prefill.py: in cubins built for sm_80+ by newer bundles; absent, prefill keeps
# prefill_causal and attend_blocks' tiles
FLASH_KERNEL = "flash_prefill_v3"     # = schedules/gpu/flash_prefill.KERNEL_NAME
STATIC_SMEM_LIMIT = 48 << 10          # shared memory a launch gets without opting in
# partial + merge in one launch: in newer bundles' cubins; absent, decode launches the two
FUSED_DECODE_KERNEL = "paged_decode_fused"
FUSED_APPEND_KERNEL = "paged_decode_fused_append"   # the decode append inside the fused attention
# paged_decode_fused_append for every sequence of a batched decode step in one launch: in newer bundles' cubins;
# absent, a batched step launches per sequence
FUSED_APPEND_BATCH_KERNEL = "paged_decode_fused_append_batch"
# schedules/gpu/paged_decode_short.py: decode attention at short contexts, in newer bundles' cubins
SHORT_KERNELS = ("paged_decode_short", "paged_decode_short_append", "paged_decode_short_append_batch")
SHORT_THREADS = 16 * 32          # = the source's SHORT_WARPS * 32
FLASH_BLOCK_Q, FLASH_BLOCK_K, FLASH_THREADS = 64, 64, 128   # = schedules/gpu/flash_prefill's


def _null(a):
    """A kernel argument for an optional device array: the array, or a null pointer for None."""
    return a if a is not None else np.uint64(0)


def flash_smem_bytes(head_dim: int) -> int:
    """= schedules/gpu/flash_prefill.smem_bytes: the K and V tiles of a launch in dynamic shared memory."""
    return 2 * FLASH_BLOCK_K * (head_dim + 8) * 2


def bundle_cuda_ops(bundle_dir: str, head_dim: int, group: int) -> "CudaOps":
    """CudaOps with the bundle's paged attention kernels, built for the model's (head_dim, group)."""
    path = os.path.join(bundle_dir, PAGED_ATTENTION_CUBIN)
    if not os.path.isfile(path):
        raise HelmcError(f"bundle {bundle_dir}: expected {PAGED_ATTENTION_CUBIN} beside the GPU stage, found none "
                         f"(a bundle from before the kernels were built ahead of time: rebuild it)")
    return CudaOps({(head_dim, group): path})


class CudaOps:
    """What KVCacheGPU needs from a device, on CuPy: buffers, streams, events, copies, the kernels.
    tests/kv_device_emulator.py implements the same methods on NumPy for CPU tests."""

    def __init__(self, cubins: dict[tuple[int, int], str] | None = None):
        """cubins: (head_dim, query heads per KV head) -> path of a paged_attention cubin built for that shape."""
        import cupy
        import cupyx
        self.cp, self.cupyx, self.xp = cupy, cupyx, cupy
        self._cubins = dict(cubins or {})
        self._kernels: dict[tuple[int, int], tuple] = {}
        self._smem_opted: set[tuple[int, int]] = set()   # flash kernels allowed past STATIC_SMEM_LIMIT
        self.num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    # buffers
    def device_empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def pinned_empty(self, shape, dtype):
        return self.cupyx.empty_pinned(shape, dtype)

    def ptr(self, a) -> int:
        return a.data.ptr if isinstance(a, self.cp.ndarray) else a.ctypes.data

    def to_device(self, a: np.ndarray):
        return self.cp.asarray(a)

    # streams and events
    def current_stream(self):
        return self.cp.cuda.get_current_stream()

    def new_stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def new_event(self):
        return self.cp.cuda.Event(disable_timing=True)

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def query(self, event) -> bool:
        return event.done

    def synchronize(self, event) -> None:
        event.synchronize()

    def synchronize_stream(self, stream) -> None:
        stream.synchronize()

    # copies (addresses in bytes)
    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream) -> None:
        self.cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)

    def memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                 stream) -> None:
        self.cp.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream.ptr)

    # kernels
    def _functions(self, head_dim: int, group: int):
        key = (head_dim, group)
        if key not in self._kernels:
            path = self._cubins.get(key)
            if path is None or not os.path.isfile(path):
                raise HelmcError(f"paged attention: expected a {PAGED_ATTENTION_CUBIN} built for head_dim {head_dim}, "
                                 f"group {group}, found {path or 'none for that shape (built: ' + str(sorted(self._cubins)) + ')'}")
            mod = self.cp.RawModule(path=path)
            def optional(name):
                try:
                    return mod.get_function(name)
                except Exception:             # CUDA_ERROR_NOT_FOUND: an older bundle (or flash below sm_80)
                    return None
            self._kernels[key] = tuple(mod.get_function(n) for n in _KERNEL_NAMES) + (
                optional(FLASH_KERNEL), optional(FUSED_DECODE_KERNEL), optional(FUSED_APPEND_KERNEL),
                optional(FUSED_APPEND_BATCH_KERNEL)) + tuple(optional(n) for n in SHORT_KERNELS)
        return self._kernels[key]

    def has_flash(self, head_dim: int, group: int) -> bool:
        """Whether the bundle's cubin for (head_dim, group) has the tensor-core prefill attention."""
        return self._functions(head_dim, group)[4] is not None

    def has_fused_decode(self, head_dim: int, group: int) -> bool:
        """Whether the bundle's cubin has paged_decode_fused (decode attention's partials and merge in one launch)."""
        return self._functions(head_dim, group)[5] is not None

    def has_fused_append(self, head_dim: int, group: int | None = None) -> bool:
        """Whether the bundle's cubin has paged_decode_fused_append (the step's K/V row written by the attention);
        group None: any cubin built for head_dim (one bundle's cubins come from one source)."""
        return self._functions(head_dim, self._any_group(head_dim) if group is None else group)[6] is not None

    def has_fused_append_batch(self, head_dim: int, group: int) -> bool:
        """Whether the bundle's cubin has paged_decode_fused_append_batch (a batched decode step in one launch)."""
        return self._functions(head_dim, group)[7] is not None

    def _any_group(self, head_dim: int) -> int:
        """A query group some cubin for head_dim was built for (kernels that do not depend on it are in each)."""
        return next((g for d, g in sorted(self._cubins) if d == head_dim), 0)

    def write_step(self, step, values: np.ndarray, stream) -> None:
        """Write int32 `values` into the device array `step` on `stream` (from pageable memory: the driver
        has read `values` when this returns, so the caller may reuse it at once)."""
        self.write(step, np.ascontiguousarray(values, np.int32), stream)

    def write(self, dst, values: np.ndarray, stream) -> None:
        """Write host `values` (dst's dtype and size) into the device array `dst` on `stream`, as write_step."""
        assert values.dtype == dst.dtype and values.nbytes == dst.nbytes and values.flags.c_contiguous, \
            (values.dtype, dst.dtype, values.nbytes, dst.nbytes)
        self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, values.ctypes.data, values.nbytes, H2D, stream.ptr)

    def decode_partial(self, q, page_ptrs, page_tokens: int, step, split_tokens: int, split_base: int,
                       n_splits: int, num_kv_heads: int, head_dim: int, scale: float, part_m, part_s, part_o) -> None:
        """q [h_a, d] fp16; step: device int32 [n_tokens, t_begin]."""
        group = q.shape[0] // num_kv_heads
        partial = self._functions(head_dim, group)[0]
        i32 = np.int32
        partial((num_kv_heads, n_splits), (WARPS * 32,),
                (q, page_ptrs, i32(page_tokens), step, i32(split_tokens), i32(split_base), i32(num_kv_heads),
                 np.float32(scale), part_m, part_s, part_o))

    def decode_fused(self, q, page_ptrs, page_tokens: int, step, split_tokens: int, split_base: int,
                     n_splits: int, num_kv_heads: int, head_dim: int, scale: float, part_m, part_s, part_o,
                     counters, out, sinks=None) -> None:
        """decode_partial over splits [split_base, split_base + n_splits), then decode_merge of them, in one
        launch; counters: device int32 [num_kv_heads], zero, and zero again after the kernel."""
        group = q.shape[0] // num_kv_heads
        fused = self._functions(head_dim, group)[5]
        i32 = np.int32
        fused((num_kv_heads, n_splits), (WARPS * 32,),
              (q, page_ptrs, i32(page_tokens), step, i32(split_tokens), i32(split_base), i32(n_splits),
               i32(num_kv_heads), np.float32(scale), part_m, part_s, part_o, counters, out, _null(sinks)))

    def decode_fused_append(self, q, k, v, page_ptrs, page_tokens: int, step, split_tokens: int, split_base: int,
                            n_splits: int, num_kv_heads: int, head_dim: int, scale: float, part_m, part_s, part_o,
                            counters, out, sinks=None) -> None:
        """decode_append of k, v [h_kv, d] fp16, then decode_fused, in one launch (the same bits)."""
        group = q.shape[0] // num_kv_heads
        kernel = self._functions(head_dim, group)[6]
        i32 = np.int32
        kernel((num_kv_heads, n_splits), (WARPS * 32,),
               (q, k, v, page_ptrs, i32(page_tokens), step, i32(split_tokens), i32(split_base), i32(n_splits),
                i32(num_kv_heads), np.float32(scale), part_m, part_s, part_o, counters, out, _null(sinks)))

    def decode_fused_append_batch(self, q, k, v, seqs_ptr: int, n_seqs: int, max_splits: int, page_tokens: int,
                                  num_kv_heads: int, head_dim: int, scale: float, out, sinks=None) -> None:
        """decode_fused_append for each of n_seqs sequences in one launch: rows b < n_seqs of q, out [>= n_seqs,
        h_a*d] and k, v [>= n_seqs, h_kv*d] fp16 contiguous; seqs_ptr: the device address of the sequences' table
        [n_seqs, SEQ_FIELDS] int64 (runtime/kv/decode_batch_gpu.py); max_splits: the most splits any sequence
        launches; sinks: the layer's, one for every sequence."""
        group = q.shape[1] // (num_kv_heads * head_dim)
        kernel = self._functions(head_dim, group)[7]
        kernel((num_kv_heads, max_splits, n_seqs), (WARPS * 32,),
               (q, k, v, np.uint64(seqs_ptr), np.int32(page_tokens), np.int32(num_kv_heads), np.float32(scale), out,
                _null(sinks)))

    def has_short_decode(self, head_dim: int, group: int) -> bool:
        """Whether the bundle's cubin has the short-context decode kernels (paged_decode_short*)."""
        return all(f is not None for f in self._functions(head_dim, group)[8:11])

    def decode_short(self, q, page_ptrs, page_tokens: int, step, num_kv_heads: int, head_dim: int, scale: float,
                     out, sinks=None) -> None:
        """Decode attention of q [h_a, d] fp16 over the step's window in one launch, no partials (short contexts)."""
        group = q.shape[0] // num_kv_heads
        self._functions(head_dim, group)[8](
            (num_kv_heads, group), (SHORT_THREADS,),
            (q, page_ptrs, np.int32(page_tokens), step, np.int32(num_kv_heads), np.float32(scale), out, _null(sinks)))

    def decode_short_append(self, q, k, v, page_ptrs, page_tokens: int, step, num_kv_heads: int, head_dim: int,
                            scale: float, out, sinks=None) -> None:
        """decode_append of k, v [h_kv, d] fp16, then decode_short, in one launch (the same bits)."""
        group = q.shape[0] // num_kv_heads
        self._functions(head_dim, group)[9](
            (num_kv_heads, group), (SHORT_THREADS,),
            (q, k, v, page_ptrs, np.int32(page_tokens), step, np.int32(num_kv_heads), np.float32(scale), out,
             _null(sinks)))

    def decode_short_append_batch(self, q, k, v, seqs_ptr: int, n_seqs: int, page_tokens: int, num_kv_heads: int,
                                  head_dim: int, scale: float, out, sinks=None) -> None:
        """decode_short_append for each sequence of the table whose n_splits field is 0 (the others: the split
        kernel's, untouched); arguments as decode_fused_append_batch's."""
        group = q.shape[1] // (num_kv_heads * head_dim)
        self._functions(head_dim, group)[10](
            (num_kv_heads, group, n_seqs), (SHORT_THREADS,),
            (q, k, v, np.uint64(seqs_ptr), np.int32(page_tokens), np.int32(num_kv_heads), np.float32(scale), out,
             _null(sinks)))

    def decode_merge(self, part_m, part_s, part_o, split_begin: int, split_end: int, num_heads: int,
                     head_dim: int, group: int, out, sinks=None) -> None:
        """out [h_a, d] fp16; the sinks join the denominator here, once (the partials have none)."""
        merge = self._functions(head_dim, group)[1]
        merge((num_heads,), (head_dim,),
              (part_m, part_s, part_o, np.int32(split_begin), np.int32(split_end), np.int32(num_heads), out,
               _null(sinks)))

    def decode_append(self, k, v, page_ptrs, page_tokens: int, num_kv_heads: int, head_dim: int, step) -> None:
        """k, v [h_kv, d] fp16 contiguous -> row step[0]-1 of their page (page_ptrs: this layer's slices).
        The kernel does not depend on the query group: any cubin built for this head_dim has it."""
        append = self._functions(head_dim, self._any_group(head_dim))[2]
        append((num_kv_heads, 2), (head_dim,), (k, v, page_ptrs, np.int32(page_tokens), np.int32(num_kv_heads), step))

    def prefill_causal(self, q, kv, num_kv_heads: int, head_dim: int, window: int, scale: float, out,
                       sinks=None) -> None:
        """A fresh prompt's causal attention: q, out [S, h_a, d] fp16, kv [2, h_kv, S, d] fp16, all contiguous."""
        S, h_a = q.shape[0], q.shape[1]
        kernel = self._functions(head_dim, h_a // num_kv_heads)[3]
        kernel((-(-S // WARPS), num_kv_heads), (WARPS * 32,),
               (q, kv, np.int32(S), np.int32(num_kv_heads), np.int32(window), np.float32(scale), out, _null(sinks)))

    def flash_prefill(self, q, k, v, n_k: int, q_pos0: int, num_kv_heads: int, window: int, scale: float,
                      out, page_ptrs=None, page_tokens: int = 0, paged_keys: int = 0, k_pos0: int = 0, state=None,
                      state_in: bool = False, state_out: bool = False, sinks=None) -> None:
        """Causal attention of n_q query rows at positions q_pos0.. over keys 0..n_k-1 on tensor cores:
        q, out [n_q, h_a, d] fp16 contiguous. Keys before paged_keys lie in pages (page_ptrs: device int64, a
        layer's slice [2, h_kv, page_tokens, d] each; paged_keys and page_tokens multiples of 64), the rest at
        rows 0.. of k, v [h_kv, >= n_k - paged_keys, d] fp16 with contiguous rows (any head stride, the same
        for both: a [2, h_kv, S, d] scratch's two halves, or a prompt chunk's own K/V). k_pos0: the position of
        this launch's key 0 (keys elsewhere: earlier ranges' launches); state [n_q, h_a, d + 2] float32: the
        softmax state (o unnormalised, m, l) read first (state_in) and written instead of out (state_out); sinks
        [h_a]: a launch without state_in starts from them."""
        n_q, h_a, d = q.shape
        head_stride = k.strides[0] // 2
        if (k.strides[1:] != (2 * d, 2) or v.strides != k.strides or k.shape[1] < n_k - paged_keys
                or not q.flags.c_contiguous or not out.flags.c_contiguous):
            raise HelmcError(f"flash_prefill: expected contiguous q/out and K, V rows of {d} halves with one head "
                             f"stride, found q {q.shape}, k strides {k.strides}, v strides {v.strides}")
        if paged_keys and (page_ptrs is None or paged_keys % FLASH_BLOCK_K or page_tokens % FLASH_BLOCK_K):
            raise HelmcError(f"flash_prefill: expected a page table and multiples of {FLASH_BLOCK_K} for paged keys, "
                             f"found paged_keys {paged_keys}, page_tokens {page_tokens}")
        kernel = self._functions(d, h_a // num_kv_heads)[4]
        smem = flash_smem_bytes(d)
        if smem > STATIC_SMEM_LIMIT and (d, h_a // num_kv_heads) not in self._smem_opted:   # head_dim 256: 66 KB
            kernel.max_dynamic_shared_size_bytes = smem            # CuPy's RawKernel sets the function attribute
            self._smem_opted.add((d, h_a // num_kv_heads))
        kernel((-(-n_q // FLASH_BLOCK_Q), h_a), (FLASH_THREADS,),
               (q, k, v, np.int64(head_stride), np.int32(n_q), np.int32(n_k), np.int32(q_pos0),
                np.int32(num_kv_heads), np.int32(window), np.float32(scale), out,
                _null(page_ptrs), np.int32(page_tokens), np.int32(paged_keys),
                np.int32(k_pos0), _null(state), np.int32(bool(state_in)), np.int32(bool(state_out)), _null(sinks)),
               shared_mem=smem)
