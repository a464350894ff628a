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

GPU_LIB = "gpu_stage.so"
GPU_CUBIN_INDEX = "gpu_stage.cubins.json"


def kv_pool_bytes(plan_pool_bytes: int, loan_bytes: int, free_bytes: int, page_bytes: int) -> int:
    """VRAM of the GPU page pool: the plan's pool in whole pages (rounded down: pages are whole), at
    least two pages (one resident, one being written), and at least the streamed prefill's loan
    (KVCacheGPU keeps its bytes past the last whole page for the loan); at most what is free. The
    plan's pool is at least its loan (cost_model.kv_page_pool_bytes), so this takes no byte it did
    not count unless the pool is under two pages. Invariant: the result holds the loan whenever
    `free_bytes` does."""
    pool = min(free_bytes, max(2 * page_bytes, plan_pool_bytes // page_bytes * page_bytes, loan_bytes))
    assert pool >= min(loan_bytes, free_bytes), (pool, loan_bytes, free_bytes)
    return pool


class GpuParts:
    def __init__(self, stage, head_fns, head_weights, act_dtype, cupy_to_tvm, tvm_to_cupy, cpu_stage_step,
                 streamed_prefill=None, cpu_kv=None, prefill_chunk_tokens: int = 0):
        self.stage = stage                      # Stage over the GPU layers, or None
        self.head_fns = head_fns
        self.head_weights = head_weights
        self.act_dtype = act_dtype
        self.cupy_to_tvm = cupy_to_tvm
        self.tvm_to_cupy = tvm_to_cupy
        self.cpu_stage_step = cpu_stage_step    # runs the CPU stage on host arrays; None if no CPU blocks
        self.streamed_prefill = streamed_prefill  # CPU blocks' prefill on the GPU (plan.prefill_on_gpu), or None
        self.cpu_kv = cpu_kv
        self.chunk = prefill_chunk_tokens       # the GPU stage runs a prompt this many tokens at a time (0: whole)

    def reset(self):
        if self.stage is not None:
            self.stage.kv.reset()

    def forward(self, session, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, phase: str, all_logits: bool):
        """x [S, H], cos/sin [S, D] on the host. A prompt stays on the host and crosses in chunks, so
        VRAM holds one chunk's activations whatever the prompt's length (the plan counts one chunk)."""
        import cupy as cp
        if phase == "prefill" and self.streamed_prefill is not None and self.cpu_kv.length == 0:
            x = self.streamed_prefill.run(x, cos, sin)             # [S, H] fp16 back on the host
        elif self.cpu_stage_step is not None:
            x = self.cpu_stage_step(x, cos, sin, phase)            # [S, H] float32 on the host
        to_tvm = self.cupy_to_tvm
        S = x.shape[0]
        if self.stage is not None:
            step = self.chunk if phase == "prefill" and self.chunk else S
            parts = []
            for c0 in range(0, S, step):                           # one KV step per chunk: bounded activations
                c1 = min(S, c0 + step)
                xg = cp.asarray(np.ascontiguousarray(x[c0:c1], self.act_dtype))   # the host-to-device crossing
                xt = self.stage.forward(to_tvm(xg), to_tvm(cp.asarray(np.ascontiguousarray(cos[c0:c1]))),
                                        to_tvm(cp.asarray(np.ascontiguousarray(sin[c0:c1]))), phase)
                parts.append(self.tvm_to_cupy(xt) if all_logits or c1 == S else None)
            xg = parts[-1] if len(parts) == 1 else (cp.concatenate(parts) if all_logits else parts[-1])
        else:
            xg = cp.asarray(np.ascontiguousarray(x if all_logits else x[-1:], self.act_dtype))
        if not all_logits and xg.shape[0] > 1:
            xg = xg[-1:]                                            # [S, H] -> [1, H]: only the last row samples
            phase = "decode"
        logits = self.head_fns[phase](to_tvm(cp.ascontiguousarray(xg)), *self.head_weights)
        return cp.asnumpy(self.tvm_to_cupy(logits))               # [S or 1, V] float32 back to the host


def load_gpu_parts(cls, bundle_dir, manifest, spec, plan, checkpoint, tokenizer, quiet, **kv_options):
    import cupy as cp
    import tvm.runtime
    from tvm.runtime.vm import VirtualMachine

    from helmc.runtime.cuda_runtime import PinnedUploader, cupy_to_tvm, load_gpu_executable, tvm_to_cupy
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    from helmc.runtime.kv.cuda_ops import bundle_cuda_ops
    from helmc.runtime.prefill_stream import streamed_prefill_bytes
    from helmc.runtime.cpu_stage import CPU_STAGE_LIB, build_cpu_stage, load_stage_library, progress
    from helmc.runtime.stage import Stage
    from helmc.runtime.weights.bind import bind_head, bind_layers

    free, total = cp.cuda.runtime.memGetInfo()
    if plan.gpu_bytes and plan.gpu_bytes > free:
        raise HelmcError(f"GPU memory: the plan needs {plan.gpu_bytes / 2**30:.2f} GiB of VRAM, "
                         f"{free / 2**30:.2f} GiB is free of {total / 2**30:.2f} GiB (build with a smaller --gpu-budget)")
    cpu_step = None
    cpu_stage = None
    if len(plan.cpu_layers):
        cpu_vm = load_stage_library(bundle_dir, CPU_STAGE_LIB)
        pinned = None
        if plan.prefill_on_gpu:
            from helmc.runtime.prefill_stream import bind_pinned_layers
            pinned, arenas = bind_pinned_layers(checkpoint, spec, plan.cpu_layers, lambda m: progress(m, quiet))
        cpu_stage, _ = build_cpu_stage(cpu_vm, spec, plan, checkpoint, quiet, bindings=pinned, **kv_options)
        dev_cpu = tvm.cpu()

        def cpu_step(x, cos, sin, phase):
            return cpu_stage.forward(tvm.runtime.tensor(x, dev_cpu), tvm.runtime.tensor(cos, dev_cpu),
                                     tvm.runtime.tensor(sin, dev_cpu), phase).numpy()

    vm = VirtualMachine(load_gpu_executable(os.path.join(bundle_dir, GPU_LIB), os.path.join(bundle_dir, GPU_CUBIN_INDEX)),
                        tvm.cuda(0))
    dev = tvm.cuda(0)
    uploader = PinnedUploader()
    upload = lambda view, dtype, d: uploader.upload(view, dtype, d)
    layers = plan.gpu_layers
    stage = None
    if len(layers):
        bindings = bind_layers(checkpoint, spec, layers, dev, lambda m: progress(m, quiet), to_device=upload)
        free_after, _ = cp.cuda.runtime.memGetInfo()
        page_tokens = kv_options.get("kv_page_tokens", 512)
        # The loan the plan counted: the streamed prefill of a prompt of the plan's length.
        loan = (streamed_prefill_bytes(max(a.nbytes for a in arenas), plan.batch * plan.prompt_len, spec)
                if plan.prefill_on_gpu else 0)
        if plan.gpu_kv_pool_bytes:
            # The plan counted weights, activations of one prefill chunk, the cache's workspace and the
            # reserve; the pages get what it left, with the loan as their floor.
            page_bytes = 2 * len(layers) * spec.num_kv_heads * page_tokens * spec.head_dim * 2
            budget = kv_pool_bytes(plan.gpu_kv_pool_bytes, loan, free_after, page_bytes)
        else:   # a plan from before gpu_kv_pool_bytes: what is left after weights and the cache's workspace
            budget = free_after - (free - plan.gpu_bytes) if plan.gpu_bytes else free_after
            budget -= KVCacheGPU.workspace_bytes(spec.num_heads, spec.num_kv_heads, spec.head_dim, page_tokens)
        kv = KVCacheGPU(len(layers), spec.num_kv_heads, spec.head_dim, page_tokens=page_tokens,
                        max_tokens=plan.max_context, vram_bytes=max(0, int(budget)),
                        watermark=kv_options.get("kv_watermark", 0.8), offload=kv_options.get("kv_offload", True),
                        sliding_window=spec.sliding_window or None, loan_bytes=loan,
                        ops=bundle_cuda_ops(bundle_dir, spec.head_dim, spec.group_size))
        stage = Stage("gpu", vm, spec, layers, kv, bindings, to_array=tvm_to_cupy, from_array=cupy_to_tvm)
    head_weights = bind_head(checkpoint, spec, dev, to_device=upload)
    uploader.close()
    head_fns = {p: vm[f"head_{p}"] for p in ("prefill", "decode")}
    streamed = None
    if plan.prefill_on_gpu:
        from helmc.runtime.prefill_stream import StreamedPrefill
        streamed = StreamedPrefill(vm, spec, arenas, cpu_stage.kv, plan.prefill_chunk_tokens or 512,
                                   cupy_to_tvm, tvm_to_cupy, lend=stage.kv.lend_empty_pool if stage else None)
    gpu = GpuParts(stage, head_fns, head_weights, cp.float16, cupy_to_tvm, tvm_to_cupy, cpu_step, streamed,
                   cpu_stage.kv if cpu_stage is not None else None, plan.prefill_chunk_tokens)
    session = cls(bundle_dir, manifest, spec, plan, checkpoint, cpu_stage, None, tokenizer, gpu=gpu)
    return session
