"""Hybrid decode on one CPU and one GPU: the staging ring, its copies and events, the crossings (CuPy + TVM).

Memory:
  * streamed blocks' weights stay where the CPU stage's weights are bound for the streamed prefill: one pinned
    arena per block (runtime/prefill_stream.PinnedBlockArena, page-locked at load, never reallocated), so a
    group's copy is one cudaMemcpyAsync per block straight from the bound weights, no second host copy;
  * the ring: one device buffer of schedule.ring_bytes; each streamed block's TVM parameters are views of its
    slot, made once (slots do not move between tokens), so the GPU computes a streamed block with the same
    compiled decode functions and the same kernels as a GPU-resident block;
  * the streamed blocks' KV is the GPU cache's (layers [0, streamed)), appended in the same step as the
    resident blocks'.
Streams: the copies go on `copy_stream` (non-blocking); everything else on the session's compute stream (the
current CuPy stream and TVM's environment stream while GpuParts.forward runs). Two kinds of events order them:
  copied[i]   recorded on copy_stream after S_i's copies; the compute stream waits it before S_i's kernels;
  ring_free   recorded on the compute stream after S_i's last kernel; the copy stream waits it before the next
              group's copies overwrite the ring (next pair, or the next token's first pair).
cudaStreamWaitEvent takes the event's latest record at the time of the call, so one event object per role,
re-recorded every token, orders each token's copies after the previous reads.
"""
from __future__ import annotations

import numpy as np

from helmc.runtime.hybrid.schedule import HybridSchedule, Pair


class CudaHybridBackend:
    def __init__(self, schedule: HybridSchedule, arenas: dict, ring, streamed_stages: list, cpu_stage, gpu_kv,
                 resident, spec, to_tvm, to_cupy):
        """arenas: layer -> PinnedBlockArena of every streamed block; ring: the device uint8 buffer the stages'
        bindings view; streamed_stages[i]: a Stage over S_i's blocks (bindings on the ring, kv_base its first
        GPU-cache layer); cpu_stage: the Stage over every CPU group's blocks; resident(x, cos, sin): the
        resident blocks and the head on device x, committing the GPU cache's step, logits on the host."""
        import cupy as cp
        import tvm.runtime

        assert ring.nbytes >= schedule.ring_bytes, (ring.nbytes, schedule.ring_bytes)
        for p in schedule.pairs:
            for s in p.slots:
                assert arenas[s.layer].nbytes == s.nbytes, (s, arenas[s.layer].nbytes)
        self.cp, self.tvm = cp, tvm.runtime
        self.schedule, self.arenas, self.ring = schedule, arenas, ring
        self.stages, self.cpu_stage, self.gpu_kv, self.resident_fn = streamed_stages, cpu_stage, gpu_kv, resident
        self.to_tvm, self.to_cupy = to_tvm, to_cupy
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.copied = [cp.cuda.Event(disable_timing=True) for _ in schedule.pairs]
        self.ring_free = cp.cuda.Event(disable_timing=True)
        self.ring_read = False                 # whether ring_free has been recorded (a group has read the ring)
        self.x = cp.empty((1, spec.hidden_size), cp.float16)
        self.cos = cp.empty((1, spec.head_dim), cp.float32)
        self.sin = cp.empty((1, spec.head_dim), cp.float32)
        self.attn = cp.empty((1, spec.q_dim), cp.float16)
        self.views = [to_tvm(a) for a in (self.x, self.cos, self.sin, self.attn)]
        self.cpu_dev = tvm.runtime.cpu()
        self.cos_host = self.sin_host = self.cos_np = self.sin_np = None
        self.bytes_copied = 0

    def begin(self, cos: np.ndarray, sin: np.ndarray) -> None:
        self.cos.set(np.ascontiguousarray(cos, np.float32).reshape(self.cos.shape))
        self.sin.set(np.ascontiguousarray(sin, np.float32).reshape(self.sin.shape))
        self.cos_np, self.sin_np = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
        self.cos_host = self.tvm.tensor(self.cos_np, self.cpu_dev)
        self.sin_host = self.tvm.tensor(self.sin_np, self.cpu_dev)
        self.gpu_kv.begin_step(1)              # reserves the row's page, writes the step's token count

    def copy(self, p: Pair) -> None:
        cp = self.cp
        if self.ring_read:
            self.copy_stream.wait_event(self.ring_free)
        base = self.ring.data.ptr
        for s in p.slots:
            src = self.arenas[s.layer].host                    # pinned (cupyx.empty_pinned), s.nbytes long
            cp.cuda.runtime.memcpyAsync(base + s.offset, src.ctypes.data, s.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, self.copy_stream.ptr)
            self.bytes_copied += s.nbytes
        self.copied[p.index].record(self.copy_stream)

    def cpu(self, p: Pair, x: np.ndarray) -> np.ndarray:
        blocks = range(p.cpu_kv_base, p.cpu_kv_base + len(p.cpu_layers))
        xt = self.tvm.tensor(np.ascontiguousarray(x, np.float32), self.cpu_dev)      # fp16 from the GPU: exact
        return self.cpu_stage.run_blocks(xt, self.cos_host, self.sin_host, "decode", blocks=blocks).numpy()

    def to_gpu(self, x: np.ndarray):
        self.x.set(np.ascontiguousarray(x, np.float16).reshape(self.x.shape))        # the host-to-device crossing
        return self.x

    def wait_copy(self, p: Pair) -> None:
        self.cp.cuda.get_current_stream().wait_event(self.copied[p.index])

    def gpu(self, p: Pair, x):
        xt, cos, sin, attn = self.views
        if x is not self.x:
            self.x[...] = x.reshape(self.x.shape)
        out = self.stages[p.index].run_blocks(xt, cos, sin, "decode", attn_out=(self.attn, attn))
        return self.to_cupy(out)

    def release_ring(self, p: Pair) -> None:
        self.ring_free.record(self.cp.cuda.get_current_stream())
        self.ring_read = True

    def to_host(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)              # synchronizes the compute stream only: the copy stream goes on

    def resident(self, x):
        return self.resident_fn(x, self.cos_np, self.sin_np)

    def finish(self) -> None:
        self.cpu_stage.kv.advance(1)

    def close(self) -> None:
        """Wait for the copies in flight (before the ring or the arenas go)."""
        self.copy_stream.synchronize()
