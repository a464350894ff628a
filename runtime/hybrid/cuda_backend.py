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
Streams, events and copies go through the GPU cache's ops (runtime/kv/cuda_ops.CudaOps on CuPy; on the CPU the
tests run this class on tests/kv_device_emulator.EmulatedOps, whose race detector checks the events below).
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
from helmc.runtime.kv.cuda_ops import H2D


class CupyArrays:
    """The backend's few array moves on CuPy and TVM (tests/hybrid emulates them on NumPy)."""

    def __init__(self):
        import cupy
        import tvm.runtime
        self.cp, self.tvm, self.cpu = cupy, tvm.runtime, tvm.runtime.cpu()

    def put(self, dst, host: np.ndarray) -> None:
        """Host -> device array, on the current stream (pageable source: the driver stages it)."""
        dst.set(np.ascontiguousarray(host, dst.dtype).reshape(dst.shape))

    def device(self, host: np.ndarray):
        """A new device array holding `host`, on the current stream."""
        return self.cp.asarray(host)

    def get(self, dev) -> np.ndarray:
        """Device -> host; synchronizes the current stream only."""
        return self.cp.asnumpy(dev)

    def copy(self, dst, src) -> None:
        """Device -> device on the current stream."""
        dst[...] = src.reshape(dst.shape)

    def host_tensor(self, a: np.ndarray):
        return self.tvm.tensor(a, self.cpu)

    def host_array(self, t) -> np.ndarray:
        return t.numpy()


class CudaHybridBackend:
    def __init__(self, schedule: HybridSchedule, arenas: dict, ring, streamed_stages: list, cpu_stage, gpu_kv,
                 resident, spec, to_tvm, to_cupy, ops=None, arrays=None, graph_stream=None):
        """arenas: layer -> PinnedBlockArena of every streamed block; ring: the device uint8 buffer the stages'
        bindings view; streamed_stages[i]: a Stage over S_i's blocks (bindings on the ring, kv_base its first
        GPU-cache layer); cpu_stage: the Stage over every CPU group's blocks; resident(x, cos, sin): the
        resident blocks and the head on device x, committing the GPU cache's step, logits on the host.
        ops: streams, events and copies (default the GPU cache's: kv/cuda_ops.CudaOps); arrays: CupyArrays;
        graph_stream: the session's compute stream, to run each streamed group as a CUDA graph on (group_graph.py;
        None: eagerly)."""
        assert ring.nbytes >= schedule.ring_bytes, (ring.nbytes, schedule.ring_bytes)
        for p in schedule.pairs:
            for s in p.slots:
                assert arenas[s.layer].nbytes == s.nbytes, (s, arenas[s.layer].nbytes)
        self.ops = ops = gpu_kv.ops if ops is None else ops
        self.arrays = arrays = CupyArrays() if arrays is None else arrays
        self.schedule, self.arenas, self.ring = schedule, arenas, ring
        self.stages, self.cpu_stage, self.gpu_kv, self.resident_fn = streamed_stages, cpu_stage, gpu_kv, resident
        self.to_tvm, self.to_cupy = to_tvm, to_cupy
        self.copy_stream = ops.new_stream()
        self.copied = [ops.new_event() for _ in schedule.pairs]
        self.ring_free = ops.new_event()
        self.ring_read = False                 # whether ring_free has been recorded (a group has read the ring)
        self.x = ops.device_empty((1, spec.hidden_size), np.float16)
        # a local RoPE (Gemma 3) makes each row [global D | local D]: each streamed block takes its half (Stage)
        self.cos = ops.device_empty((1, spec.rope_width), np.float32)
        self.sin = ops.device_empty((1, spec.rope_width), np.float32)
        self.attn = ops.device_empty((1, spec.q_dim), np.float16)
        self.views = [to_tvm(a) for a in (self.x, self.cos, self.sin, self.attn)]
        self.graphs = None
        if graph_stream is not None:
            from helmc.runtime.hybrid.group_graph import GroupGraph
            self.graphs = [GroupGraph(st, self.views, self.attn, graph_stream, to_cupy) for st in streamed_stages]
        self.cos_host = self.sin_host = self.cos_np = self.sin_np = None
        self.bytes_copied = 0

    def begin(self, cos: np.ndarray, sin: np.ndarray) -> None:
        self.cos_np, self.sin_np = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
        self.arrays.put(self.cos, self.cos_np)
        self.arrays.put(self.sin, self.sin_np)
        self.cos_host, self.sin_host = self.arrays.host_tensor(self.cos_np), self.arrays.host_tensor(self.sin_np)
        self.gpu_kv.begin_step(1)              # reserves the row's page, writes the step's token count

    def copy(self, p: Pair) -> None:
        ops = self.ops
        if self.ring_read:
            ops.wait(self.copy_stream, self.ring_free)        # the last group's kernels have read the ring
        base = ops.ptr(self.ring)
        for s in p.slots:
            # one DMA per block, from its pinned arena (cupyx.empty_pinned) to its slot: s.nbytes bytes
            ops.memcpy(base + s.offset, ops.ptr(self.arenas[s.layer].host), s.nbytes, H2D, self.copy_stream)
            self.bytes_copied += s.nbytes
        ops.record(self.copied[p.index], self.copy_stream)

    def cpu(self, p: Pair, x: np.ndarray) -> np.ndarray:
        blocks = range(p.cpu_kv_base, p.cpu_kv_base + len(p.cpu_layers))
        xt = self.arrays.host_tensor(np.ascontiguousarray(x, np.float32))          # fp16 from the GPU: exact
        out = self.cpu_stage.run_blocks(xt, self.cos_host, self.sin_host, "decode", blocks=blocks)
        return self.arrays.host_array(out)

    def to_gpu(self, x: np.ndarray):
        self.arrays.put(self.x, x)                                                  # the host-to-device crossing
        return self.x

    def wait_copy(self, p: Pair) -> None:
        self.ops.wait(self.ops.current_stream(), self.copied[p.index])

    def gpu(self, p: Pair, x):
        xt, cos, sin, attn = self.views
        if x is not self.x:
            self.arrays.copy(self.x, x)
        if self.graphs is not None:
            return self.graphs[p.index].run()
        out = self.stages[p.index].run_blocks(xt, cos, sin, "decode", attn_out=(self.attn, attn))
        return self.to_cupy(out)

    def release_ring(self, p: Pair) -> None:
        self.ops.record(self.ring_free, self.ops.current_stream())
        self.ring_read = True

    def to_host(self, x) -> np.ndarray:
        return self.arrays.get(x)              # synchronizes the compute stream only: the copy stream goes on

    def resident(self, x):
        return self.resident_fn(x, self.cos_np, self.sin_np)

    def finish(self) -> None:
        self.cpu_stage.kv.advance(1)

    def close(self) -> None:
        """Wait for the copies in flight (before the ring or the arenas go)."""
        self.ops.synchronize_stream(self.copy_stream)
