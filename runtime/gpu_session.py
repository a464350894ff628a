"""The GPU half of a session: the GPU stage, its paged KV cache, the head, and the one crossing.

Per step (thesis 4.2.1): the CPU stage runs its blocks on the host, the hidden state [S, H] goes to
the GPU in one host-to-device copy, the GPU stage runs the remaining blocks and the head, and the
logits of the last row come back. The embedding is always gathered on the host from the mmapped
checkpoint (S rows, not V x H bytes of VRAM). Imports CuPy: only loaded when the plan has a GPU stage.
"""
from __future__ import annotations

import os

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.kv.options import KVOptions
from helmc.runtime.decode_graph import DecodeGraph, logits_out
from helmc.runtime.stage import batch_phase

GPU_LIB = "gpu_stage.so"
GPU_CUBIN_INDEX = "gpu_stage.cubins.json"


def kv_pool_bytes(plan_pool_bytes: int, loan_bytes: int, free_bytes: int, page_bytes: int,
                  loan_beside: bool = False) -> int:
    """VRAM of the GPU page pool: the plan's pool in whole pages (rounded down: pages are whole), at
    least two pages (one resident, one being written), and at least the streamed prefill's loan
    (KVCacheGPU keeps its bytes past the last whole page for the loan); at most what is free. The
    plan's pool is at least its loan (cost_model.kv_page_pool_bytes), so this takes no byte it did
    not count unless the pool is under two pages. loan_beside (a plan for several sequences: the loan is
    held beside the pages, runtime/serve/batch_model.py): the pages' part is rounded, the loan kept whole.
    Invariant: the result holds the loan whenever `free_bytes` does."""
    pages = (plan_pool_bytes - loan_bytes if loan_beside else plan_pool_bytes) // page_bytes * page_bytes
    pool = min(free_bytes, max(2 * page_bytes, pages + (loan_bytes if loan_beside else 0), loan_bytes))
    assert pool >= min(loan_bytes, free_bytes), (pool, loan_bytes, free_bytes)
    return pool


def to_device(cp, a: np.ndarray, dtype):
    """A host array on the device as `dtype`, converted there: NumPy's float32 -> float16 is a scalar loop (~3 ms
    for a 128-token prompt's rows of Qwen3-8B), the GPU's the same IEEE rounding in microseconds."""
    d = cp.asarray(np.ascontiguousarray(a))
    return d if d.dtype == dtype else d.astype(dtype)


class GpuParts:
    def __init__(self, stage, head_fns, head_weights, act_dtype, cupy_to_tvm, tvm_to_cupy, cpu_stage_step,
                 streamed_prefill=None, cpu_kv=None, prefill_chunk_tokens: int = 0, decode_graph=None, stream=None,
                 hybrid=None, loan_in_ring: bool = False):
        self.stage = stage                      # Stage over the GPU layers, or None
        self.head_fns = head_fns
        self.head_weights = head_weights
        self.act_dtype = act_dtype
        self.cupy_to_tvm = cupy_to_tvm
        self.tvm_to_cupy = tvm_to_cupy
        self.cpu_stage_step = cpu_stage_step    # runs the CPU stage on host arrays; None if no CPU blocks
        self.streamed_prefill = streamed_prefill  # CPU blocks' prefill on the GPU (plan.placement.prefill_on_gpu), or None
        self.cpu_kv = cpu_kv
        self.chunk = prefill_chunk_tokens       # the GPU stage runs a prompt this many tokens at a time (0: whole)
        self.decode_graph = decode_graph        # DecodeGraph, or None (no GPU blocks, or graphs turned off)
        self.stream = stream                    # every kernel and copy of a step, TVM's and CuPy's, goes here
        self.hybrid = hybrid                    # HybridDecode (runtime/hybrid/) for a hybrid plan's decode, or None
        self._batch_decode = None               # its batched twin (runtime/hybrid/batch.py), made on first use
        self.loan_in_ring = loan_in_ring        # the streamed prefill borrows the hybrid ring (load_gpu_parts)

    def reset(self):
        if self.stage is not None:
            self.stage.kv.reset()
        if self.hybrid is not None:
            self.hybrid.backend.cpu_stage.kv.reset()

    def forward(self, session, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, phase: str, all_logits: bool,
                argmax: bool = False):
        """Logits [S or 1, V] on the host, or with argmax (not with all_logits) the last row's greedy token."""
        from helmc.runtime.cuda_runtime import tvm_stream
        with self.stream, tvm_stream(self.stream):
            if phase == "decode" and self.hybrid is not None:
                logits = self.hybrid.step(x, cos, sin)              # the plan's groups (runtime/hybrid/)
                return int(np.argmax(logits[-1])) if argmax else logits
            if phase == "decode" and self.decode_graph is not None and not all_logits:
                if self.cpu_stage_step is not None:
                    x = self.cpu_stage_step(x, cos, sin, phase)    # [1, H] float32 on the host
                return self.decode_graph.step(x, cos, sin, argmax=argmax)
            return self._forward(x, cos, sin, phase, all_logits, argmax)

    def _forward(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, phase: str, all_logits: bool,
                 argmax: bool = False):
        """x [S, H], cos/sin [S, D] on the host. A prompt stays on the host and crosses in chunks, so
        VRAM holds one chunk's activations whatever the prompt's length (the plan counts one chunk)."""
        import cupy as cp
        gpu_rows = {}
        if phase == "prefill" and self.streamed_prefill is not None and self.cpu_kv.length == 0:
            x = self.streamed_prefill.run(x, cos, sin)             # [S, H] fp16 back on the host
            gpu_rows = self.streamed_prefill.take_gpu_rows()[0]    # hybrid: the streamed blocks' K, V
        elif self.hybrid is not None:
            raise HelmcError("hybrid decode: a prompt runs only on an empty cache, through the streamed prefill; "
                             f"found {self.cpu_kv.length} tokens cached")
        elif self.cpu_stage_step is not None:
            x = self.cpu_stage_step(x, cos, sin, phase)            # [S, H] float32 on the host
        to_tvm = self.cupy_to_tvm
        S = x.shape[0]
        if self.stage is not None:
            step = self.chunk if phase == "prefill" and self.chunk else S
            parts = []
            for c0 in range(0, S, step):                           # one KV step per chunk: bounded activations
                c1 = min(S, c0 + step)
                for layer, (k, v) in gpu_rows.items():            # same KV step as the resident blocks' rows
                    self.stage.kv.append(layer, cp.asarray(k[c0:c1]), cp.asarray(v[c0:c1]))
                xg = to_device(cp, x[c0:c1], self.act_dtype)               # the host-to-device crossing
                xt = self.stage.forward(to_tvm(xg), to_tvm(cp.asarray(np.ascontiguousarray(cos[c0:c1]))),
                                        to_tvm(cp.asarray(np.ascontiguousarray(sin[c0:c1]))), phase)
                parts.append(self.tvm_to_cupy(xt) if all_logits or c1 == S else None)
            xg = parts[-1] if len(parts) == 1 else (cp.concatenate(parts) if all_logits else parts[-1])
        else:
            xg = to_device(cp, x if all_logits else x[-1:], self.act_dtype)
        if not all_logits and xg.shape[0] > 1:
            xg = xg[-1:]                                            # [S, H] -> [1, H]: only the last row samples
            phase = "decode"
        logits = self.head_fns[phase](to_tvm(cp.ascontiguousarray(xg)), *self.head_weights)
        return logits_out(self.tvm_to_cupy(logits), argmax and not all_logits)   # [S or 1, V] float32, or a token

    def forward_batch(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cpu_stage, cpu_caches, gpu_caches,
                      rows: list[int]) -> np.ndarray:
        """Several sequences in one step (runtime/serve/batch_model.py): x [S, H], cos/sin [S, D] on the host,
        sequence b owns the next rows[b] rows and the caches cpu_caches[b] / gpu_caches[b]. Both stages run
        Stage.forward_batch; one crossing for all rows; the head on each sequence's last row. Logits [B, V]."""
        from helmc.runtime.cuda_runtime import tvm_stream
        with self.stream, tvm_stream(self.stream):
            if self.hybrid is not None:
                return self._hybrid_batch(x, cos, sin, cpu_caches, gpu_caches, rows)
            return self._forward_batch(x, cos, sin, cpu_stage, cpu_caches, gpu_caches, rows)

    def _hybrid_batch(self, x, cos, sin, cpu_caches, gpu_caches, rows):
        """A decode step of several sequences through the hybrid plan's groups (runtime/hybrid/batch.py); a
        prompt goes through the streamed prefill instead (BatchModel), so every sequence has one row here."""
        if not all(n == 1 for n in rows):
            raise HelmcError(f"hybrid decode: a batched step expected one token per sequence, found rows {rows}")
        if self._batch_decode is None:
            from helmc.runtime.hybrid.batch import BatchHybridBackend
            from helmc.runtime.hybrid.executor import HybridDecode
            self._batch_decode = HybridDecode(self.hybrid.schedule, BatchHybridBackend(
                self.hybrid.backend, self.stage, self.head_fns, self.head_weights))
        self._batch_decode.backend.bind(cpu_caches, gpu_caches, rows)
        return self._batch_decode.step(x, cos, sin)                 # [B, V] on the host

    def _forward_batch(self, x, cos, sin, cpu_stage, cpu_caches, gpu_caches, rows):
        import cupy as cp
        import tvm.runtime
        if cpu_stage is not None and len(cpu_stage.bindings):
            dev = tvm.cpu()
            x = cpu_stage.forward_batch(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(cos, dev),
                                        tvm.runtime.tensor(sin, dev), cpu_caches, rows).numpy()   # [S, H] float32
        to_tvm = self.cupy_to_tvm
        xg = to_device(cp, x, self.act_dtype)                                    # the host-to-device crossing
        if self.stage is not None:
            xg = self.tvm_to_cupy(self.stage.forward_batch(to_tvm(xg), to_tvm(cp.asarray(np.ascontiguousarray(cos))),
                                                           to_tvm(cp.asarray(np.ascontiguousarray(sin))), gpu_caches, rows))
        if len(rows) > 1 and all(n == 1 for n in rows):    # a batched decode step: its variant's head, padding dropped
            logits = self.head_fns[batch_phase(xg.shape[0])](to_tvm(xg), *self.head_weights)
            return cp.asnumpy(self.tvm_to_cupy(logits)[:len(rows)])              # [padded, V] -> [B, V] on the host
        last = np.cumsum(rows) - 1
        if xg.shape[0] != len(rows):
            xg = cp.ascontiguousarray(xg[cp.asarray(last)])                     # [S, H] -> [B, H]: last rows sample
        logits = self.head_fns["decode" if len(rows) == 1 else "prefill"](to_tvm(xg), *self.head_weights)
        return cp.asnumpy(self.tvm_to_cupy(logits))                              # [B, V] float32 back to the host


    def finish_prefill(self, xs: list, coss: list, sins: list, gpu_caches, gpu_rows: list | None = None) -> list[np.ndarray]:
        """After the streamed prefill of several prompts (BatchModel._prefill_streamed, on this stream): each
        prompt's x [S_b, H] (host, fp16) through the GPU stage on its own cache gpu_caches[b], chunk by chunk as
        _forward runs one prompt, then the head on the last rows (one: the decode head, as _forward; several:
        the batched decode variant, each row as the one-row head). Logits [V] per prompt, on the host.
        gpu_rows[b] (hybrid decode): the streamed blocks' K, V of prompt b by GPU-cache layer
        (StreamedPrefill.take_gpu_rows), appended chunk by chunk in the resident blocks' KV step, as _forward does."""
        import cupy as cp
        to_tvm, last = self.cupy_to_tvm, []
        for b, (x, cos, sin) in enumerate(zip(xs, coss, sins)):
            S, xg = x.shape[0], None
            step = self.chunk or S
            for c0 in range(0, S, step):
                c1 = min(S, c0 + step)
                for layer, (k, v) in (gpu_rows[b] if gpu_rows else {}).items():
                    gpu_caches[b].append(layer, cp.asarray(k[c0:c1]), cp.asarray(v[c0:c1]))
                xg = to_device(cp, x[c0:c1], self.act_dtype)                         # the host-to-device crossing
                if self.stage is not None:
                    xg = self.tvm_to_cupy(self.stage.forward_batch(
                        to_tvm(xg), to_tvm(cp.asarray(np.ascontiguousarray(cos[c0:c1]))),
                        to_tvm(cp.asarray(np.ascontiguousarray(sin[c0:c1]))), [gpu_caches[b]], [c1 - c0]))
            last.append(xg[-1:])                                                     # [n, H] -> [1, H]
        return list(self._head_of_last_rows(last))                                   # [B, V] -> B x [V]

    def _head_of_last_rows(self, last: list):
        """Logits [B, V] on the host of B last rows [1, H] on the device: one through the decode head (as _forward
        runs it), several through the batched decode variant padded to its size (each row as the one-row head)."""
        import cupy as cp
        to_tvm = self.cupy_to_tvm
        if len(last) == 1:
            logits = self.head_fns["decode"](to_tvm(cp.ascontiguousarray(last[0])), *self.head_weights)
            return cp.asnumpy(self.tvm_to_cupy(logits))                              # [1, V]
        sizes = sorted(int(p[len("decode_b"):]) for p in self.head_fns if p.startswith("decode_b"))
        padded = next(b for b in sizes if b >= len(last))
        rows = last + [cp.zeros((padded - len(last), last[0].shape[1]), last[0].dtype)]   # padding rows
        logits = self.head_fns[batch_phase(padded)](to_tvm(cp.ascontiguousarray(cp.concatenate(rows))),
                                                    *self.head_weights)
        return cp.asnumpy(self.tvm_to_cupy(logits)[:len(last)])                      # [padded, V] -> [B, V]

    def prefill_batch(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cpu_stage, cpu_caches, gpu_caches,
                      rows: list[int]) -> np.ndarray:
        """A step of BatchModel.prefill_many (several prompts' chunks, each of more than one row): the CPU stage on
        every sequence's rows at once, the GPU stage sequence by sequence as a one-sequence prefill runs it (cuBLAS
        picks its GEMM by the row count, so rows of a larger call need not match bit for bit), the head on the last
        rows through the batched decode variant (each row as the one-row decode head). Logits [B, V] on the host."""
        import cupy as cp
        import tvm.runtime
        from helmc.runtime.cuda_runtime import tvm_stream
        with self.stream, tvm_stream(self.stream):
            if cpu_stage is not None and len(cpu_stage.bindings):
                dev = tvm.cpu()
                x = cpu_stage.forward_batch(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(cos, dev),
                                            tvm.runtime.tensor(sin, dev), cpu_caches, rows).numpy()   # [S, H] fp32
            to_tvm, last, a = self.cupy_to_tvm, [], 0
            for b, n in enumerate(rows):
                xg = cp.asarray(np.ascontiguousarray(x[a:a + n], self.act_dtype))   # the host-to-device crossing
                if self.stage is not None:
                    xg = self.tvm_to_cupy(self.stage.forward_batch(
                        to_tvm(xg), to_tvm(cp.asarray(np.ascontiguousarray(cos[a:a + n]))),
                        to_tvm(cp.asarray(np.ascontiguousarray(sin[a:a + n]))), [gpu_caches[b]], [n]))
                last.append(xg[-1:])
                a += n
            return self._head_of_last_rows(last)                                    # [B, V], B = len(rows) > 1

def gpu_cache_layers(placement) -> tuple[int, ...]:
    """The blocks of the GPU cache's layers, in its index order: a hybrid plan's streamed blocks first (in the
    schedule's order, hybrid/schedule.HybridSchedule.gpu_kv_layers), then the GPU-resident ones."""
    return tuple(placement.streamed_layers) + tuple(placement.gpu_layers)


def gpu_cache_windows(spec, placement) -> tuple[int, ...]:
    """Each GPU cache layer's window: its block's own (ModelSpec.layer_window; Gemma 3's differ per block)."""
    return tuple(spec.layer_window(i) for i in gpu_cache_layers(placement))


def _gpu_kv_cache(bundle_dir, spec, plan, checkpoint, kv_options: KVOptions, kv_layers: int, free: int,
                  pool_loan: int):
    """The GPU stage's paged KV cache, after its weights are bound: the pages get what the plan left them, with the
    streamed prefill's loan as their floor, and its blocks' attention sinks (gpu_cache_layers' order) where the model
    has them. free: the VRAM free before anything of the session was allocated."""
    mem, wl = plan.memory, plan.workload
    import cupy as cp

    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    from helmc.runtime.kv.cuda_ops import bundle_cuda_ops
    from helmc.runtime.weights.bind import layer_sinks
    free_after, _ = cp.cuda.runtime.memGetInfo()
    page_tokens = kv_options.page_tokens
    if mem.gpu_kv_pool_bytes:
        # The plan counted weights, activations of one prefill chunk, the cache's workspace and the
        # reserve; the pages get what it left, with the loan as their floor.
        page_bytes = 2 * kv_layers * spec.num_kv_heads * page_tokens * spec.head_dim * 2
        budget = kv_pool_bytes(mem.gpu_kv_pool_bytes, pool_loan, free_after, page_bytes, loan_beside=wl.batch > 1)
    else:   # a plan from before gpu_kv_pool_bytes: what is left after weights and the cache's workspace
        budget = free_after - (free - mem.gpu_bytes) if mem.gpu_bytes else free_after
        budget -= KVCacheGPU.workspace_bytes(spec.num_heads, spec.num_kv_heads, spec.head_dim, page_tokens)
    return KVCacheGPU(kv_layers, spec.num_kv_heads, spec.head_dim, page_tokens=page_tokens,
                      max_tokens=mem.max_context, vram_bytes=max(0, int(budget)),
                      watermark=kv_options.watermark, offload=kv_options.offload,
                      sliding_window=gpu_cache_windows(spec, plan.placement), loan_bytes=pool_loan,
                      ops=bundle_cuda_ops(bundle_dir, spec.head_dim, spec.group_size),
                      sinks=layer_sinks(checkpoint, spec, gpu_cache_layers(plan.placement)))


def _check_gpu_plan(plan) -> int:
    """The VRAM free now, after checking the plan fits it and a hybrid plan streams its prefill."""
    pl, mem = plan.placement, plan.memory
    import cupy as cp
    free, total = cp.cuda.runtime.memGetInfo()
    if mem.gpu_bytes and mem.gpu_bytes > free:
        raise HelmcError(f"GPU memory: the plan needs {mem.gpu_bytes / 2**30:.2f} GiB of VRAM, "
                         f"{free / 2**30:.2f} GiB is free of {total / 2**30:.2f} GiB (build with a smaller --gpu-budget)")
    if pl.is_hybrid and not pl.prefill_on_gpu:
        raise HelmcError("hybrid decode: expected a plan whose prefill streams the host-resident blocks to the GPU "
                         "(prefill_on_gpu), found one without")
    return free


def _load_cpu_part(bundle_dir, manifest, spec, plan, checkpoint, quiet, kv_options: KVOptions):
    """(cpu_stage, cpu_vm, cpu_step, arenas): the CPU stage of the blocks the CPU computes in decode, its library,
    its one-call step on NumPy arrays and, with streamed prefill, the pinned arenas of the host-resident blocks;
    Nones where the plan puts no block on the host."""
    pl = plan.placement
    import tvm.runtime

    from helmc.runtime.cpu_stage import CPU_STAGE_LIB, build_cpu_stage, load_stage_library, loader_progress
    hybrid = pl.is_hybrid
    cpu_blocks = pl.cpu_compute_layers if hybrid else pl.cpu_layers    # the blocks the CPU computes in decode
    if not len(pl.cpu_layers):
        return None, None, None, None
    cpu_vm = load_stage_library(bundle_dir, manifest, CPU_STAGE_LIB)
    pinned = arenas = None
    if pl.prefill_on_gpu:
        from helmc.runtime.prefill_stream import bind_pinned_layers
        pinned, arenas = bind_pinned_layers(checkpoint, spec, pl.cpu_layers, loader_progress(quiet))
        if hybrid:     # the CPU groups' arenas; the streamed blocks' arenas are the ring's sources
            pinned = [a.binding for a in arenas if a.layer in set(cpu_blocks)]
    cpu_stage, _ = build_cpu_stage(cpu_vm, spec, plan, checkpoint, quiet, bindings=pinned, layers=cpu_blocks,
                                   kv=kv_options)
    dev_cpu = tvm.cpu()

    def cpu_step(x, cos, sin, phase):
        return cpu_stage.forward(tvm.runtime.tensor(x, dev_cpu), tvm.runtime.tensor(cos, dev_cpu),
                                 tvm.runtime.tensor(sin, dev_cpu), phase).numpy()
    return cpu_stage, cpu_vm, cpu_step, arenas


def _prefill_loans(plan, spec, arenas, ring) -> tuple[int, bool, bool]:
    """(the pool's loan in bytes, whether the ring lends the whole loan, whether it lends the block's staging)."""
    pl, wl = plan.placement, plan.workload
    from helmc.runtime.prefill_stream import aligned_bytes, streamed_prefill_bytes
    hybrid = pl.is_hybrid
    # The loan the plan counted: the streamed prefill of a prompt of the plan's length. A hybrid plan for several
    # sequences whose ring, idle between decode steps, holds it lends the ring (cost_model.ring_hosts_loan): then
    # the pool keeps no room for it.
    arena_bytes = max(a.nbytes for a in arenas) if pl.prefill_on_gpu else 0
    loan = streamed_prefill_bytes(arena_bytes, [wl.prompt_len] * wl.batch, spec) if pl.prefill_on_gpu else 0
    ring_lends = hybrid and wl.batch > 1 and ring.nbytes >= loan
    # Otherwise the ring lends the block's staging, the pool (or, serving, the loan beside its pages) holding the
    # prompts' buffers (cost_model.pool_loan_bytes counts the same).
    arena_in_ring = hybrid and not ring_lends and ring.nbytes >= arena_bytes
    if arena_in_ring:
        loan -= aligned_bytes(arena_bytes)
    return loan, ring_lends, arena_in_ring


def _gpu_stage(bundle_dir, manifest, spec, plan, checkpoint, quiet, kv_options: KVOptions, vm, cpu_vm, upload,
               kv_layers: int, free: int, pool_loan: int):
    """The GPU stage of plan.placement.gpu_layers: its weights bound (a MoE block's routed experts on the host, or those the
    plan puts in VRAM), then its KV cache of kv_layers layers in what they leave."""
    pl, mem, wl = plan.placement, plan.memory, plan.workload
    import tvm.runtime

    from helmc.runtime.cpu_stage import CPU_STAGE_LIB, load_stage_library, loader_progress
    from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_to_cupy
    from helmc.runtime.stage import Stage, decode_batch_sizes
    from helmc.runtime.weights.bind import bind_layers
    layers = pl.gpu_layers
    moe = None
    if any(spec.is_moe_layer(i) for i in layers):    # the routed experts stay on the host, computed by the CPU
        from helmc.runtime.moe_gpu import gpu_moe_feed_forward
        from helmc.runtime.weights.bind import tensor_to_device
        cpu_vm = cpu_vm or load_stage_library(bundle_dir, manifest, CPU_STAGE_LIB)
        moe = gpu_moe_feed_forward(cpu_vm, vm, spec, layers, decode_batch_sizes(wl.batch), tvm_to_cupy,
                                   cupy_to_tvm, mem.expert_staging_bytes)
    bindings = bind_layers(checkpoint, spec, layers, tvm.cuda(0), loader_progress(quiet), to_device=upload,
                           experts_on=(tvm.cpu(), tensor_to_device) if moe is not None else None,
                           experts_in_vram=pl.gpu_experts, expert_cache=_expert_cache(pl))
    if moe is not None and moe.prefill is not None:      # locked at load, not inside the first prompt's TTFT
        moe.prefill.lock_host_experts([b.post[-1] for i, b in zip(layers, bindings) if spec.is_moe_layer(i)])
    kv = _gpu_kv_cache(bundle_dir, spec, plan, checkpoint, kv_options, kv_layers, free, pool_loan)
    return Stage("gpu", vm, spec, layers, kv, bindings, to_array=tvm_to_cupy, from_array=cupy_to_tvm,
                 batch_sizes=decode_batch_sizes(wl.batch), kv_base=kv_layers - len(layers), moe=moe)


def _expert_cache(pl):
    """The VRAM expert cache's options where the plan turns it on (Plan.placement.expert_cache), else None."""
    if not pl.expert_cache:
        return None
    from helmc.runtime.moe_expert_cache import ExpertCacheOptions
    return ExpertCacheOptions()


def _decode_graph(stage, head_fns, head_weights, spec, stream, kv_options: KVOptions, hybrid: bool):
    """The decode step's CUDA graph: DecodeGraph for dense blocks; MoeDecodeGraph (graphs between the host's halves)
    when every MoE block runs on the one-call decode row; None without GPU blocks, with graphs off, or for MoE
    blocks on the per-expert path (each waits on the host mid-block)."""
    from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_to_cupy
    if stage is None or not kv_options.cuda_graph:
        return None
    if stage._moe is None:
        return DecodeGraph(stage, head_fns, head_weights, spec, stream, cupy_to_tvm, tvm_to_cupy)
    from helmc.runtime.moe_decode_graph import MoeDecodeGraph
    if hybrid or not MoeDecodeGraph.applies(stage):
        return None
    return MoeDecodeGraph(stage, head_fns, head_weights, spec, stream, cupy_to_tvm, tvm_to_cupy)


def load_gpu_parts(cls, bundle_dir, manifest, spec, plan, checkpoint, tokenizer, quiet, kv_options: KVOptions):
    pl, wl = plan.placement, plan.workload
    import cupy as cp
    import tvm.runtime

    from helmc.runtime.cuda_runtime import PinnedUploader, cupy_to_tvm, load_gpu_executable, tvm_to_cupy
    from helmc.runtime.cpu_stage import load_stage_library, progress
    from helmc.runtime.stage import batch_phase, decode_batch_sizes
    from helmc.runtime.weights.bind import bind_head, layer_sinks

    free = _check_gpu_plan(plan)
    hybrid = pl.is_hybrid
    cpu_stage, cpu_vm, cpu_step, arenas = _load_cpu_part(bundle_dir, manifest, spec, plan, checkpoint, quiet,
                                                         kv_options)
    vm = load_stage_library(bundle_dir, manifest, GPU_LIB, tvm.cuda(0),
                            lambda path: load_gpu_executable(path, os.path.join(bundle_dir, GPU_CUBIN_INDEX)))
    dev = tvm.cuda(0)
    uploader = PinnedUploader()
    upload = lambda view, dtype, d: uploader.upload(view, dtype, d)
    schedule = ring = None
    if hybrid:             # before the KV pool takes what is left: the plan counted the ring as workspace
        from helmc.runtime.hybrid.load import allocate_ring
        schedule, ring = allocate_ring(plan, arenas)
        if schedule.gpu_kv_layers != gpu_cache_layers(pl):     # the cache's windows follow gpu_cache_layers
            raise HelmcError(f"hybrid decode: GPU cache blocks expected {gpu_cache_layers(pl)}, found the schedule's "
                             f"{schedule.gpu_kv_layers}")
    loan, ring_lends, arena_in_ring = _prefill_loans(plan, spec, arenas, ring)
    kv_layers = len(schedule.gpu_kv_layers) if hybrid else len(pl.gpu_layers)    # hybrid: streamed blocks first
    stage = (_gpu_stage(bundle_dir, manifest, spec, plan, checkpoint, quiet, kv_options, vm, cpu_vm, upload,
                        kv_layers, free, 0 if ring_lends else loan) if kv_layers else None)
    head_weights = bind_head(checkpoint, spec, dev, to_device=upload)
    uploader.close()
    head_fns = {p: vm[f"head_{p}"] for p in ("prefill", "decode") + tuple(map(batch_phase, decode_batch_sizes(wl.batch)))}
    streamed = None
    if pl.prefill_on_gpu:
        from helmc.runtime.prefill_stream import StreamedPrefill
        from helmc.runtime.hybrid.load import prefill_kv_targets, ring_lender
        lend = ring_lender(ring) if ring_lends else (stage.kv.lend_empty_pool if stage else None)
        streamed = StreamedPrefill(vm, spec, arenas, cpu_stage.kv, pl.prefill_chunk_tokens or 512,
                                   cupy_to_tvm, tvm_to_cupy, lend=lend,
                                   kv_targets=prefill_kv_targets(schedule, arenas) if hybrid else None,
                                   ops=stage.kv.ops if stage is not None else None,
                                   lend_arena=ring_lender(ring) if arena_in_ring else None,
                                   sinks=layer_sinks(checkpoint, spec, [a.layer for a in arenas]))
    stream = cp.cuda.Stream(non_blocking=True)
    graph = _decode_graph(stage, head_fns, head_weights, spec, stream, kv_options, hybrid)
    decode = None
    if hybrid:
        from helmc.runtime.hybrid.load import hybrid_decode
        decode = hybrid_decode(schedule, ring, arenas, vm, spec, cpu_stage, stage, graph, head_fns, head_weights,
                               cupy_to_tvm, tvm_to_cupy)
        progress(f"  hybrid decode: {schedule.describe()}", quiet)
        cpu_step = None    # the CPU stage holds only the CPU groups: decode goes through the schedule
    gpu = GpuParts(stage, head_fns, head_weights, cp.float16, cupy_to_tvm, tvm_to_cupy, cpu_step, streamed,
                   cpu_stage.kv if cpu_stage is not None else None, pl.prefill_chunk_tokens, graph, stream,
                   hybrid=decode, loan_in_ring=ring_lends)
    session = cls(bundle_dir, manifest, spec, plan, checkpoint, cpu_stage, None, tokenizer, gpu=gpu)
    return session
