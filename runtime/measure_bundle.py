"""Timing helmc's own decode step on this machine, for `helmc calibrate` (thesis 6.4.4).

What the cost model leaves out of a decode step (Python, the Relax VM, kernel launches, attention
over the KV cache, array wrapping) is measured here on the real per-block path: the bundle's
compiled stage run through runtime.stage.Stage with its KV cache, with the checkpoint's weights.

  - Per device the plan puts blocks on: one decode step through as many blocks as the plan puts
    there. Weights of a few distinct blocks are bound and cycled (enough of them to overflow the
    CPU's last-level cache, as a real step's blocks do), so memory holds a fraction of the model.
    The KV cache is filled to a context from which the timed steps' mean context equals the plan's
    mean decode context (prompt_len + output_len / 2), the context the cost model charges.
  - The step's tail on the device that holds the lm_head, as Session.forward runs it: RoPE rows,
    embedding gather, (on the GPU: the hidden state and RoPE rows copied host to device, timed on
    their own too), head, logits to the host, greedy sampling.

No fitting here (helmc.planner.calibrate compares these times with the cost model). Imports NumPy, the
TVM runtime and, for a GPU stage, CuPy: this runs with TVM_USE_RUNTIME_LIB=1.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan
from helmc.runtime.kv.options import KV_PAGE_TOKENS   # the sessions' default page size

from helmc.runtime.rope import rope_tables
from helmc.runtime.weights.bind import Embedding, open_checkpoint
from helmc.runtime.weights.safetensors_mmap import Checkpoint
from helmc.runtime.sampling import Sampler, SamplingParams

PARTS = ("cpu_blocks", "gpu_blocks", "cpu_head", "gpu_head")
MIN_DISTINCT_BLOCKS = 2             # a block never follows itself, whatever the cache size


@dataclass(frozen=True)
class StageTiming:
    """Decode steps through `blocks` blocks of one device's stage."""
    device: str                     # "cpu" | "gpu"
    blocks: int                     # blocks per step (the plan's count on this device)
    distinct_blocks: int            # blocks of distinct weights bound and cycled over `blocks`
    first_context: int              # tokens cached before the first timed step
    step_ms: tuple[float, ...]      # each timed step, wall clock, device work included

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def per_block_ms(self) -> float:
        return self.p50_ms / self.blocks

    @property
    def mean_context(self) -> float:
        """Mean tokens attended over by the timed steps (each step attends over its own token too)."""
        return self.first_context + (len(self.step_ms) + 1) / 2


@dataclass(frozen=True)
class TailTiming:
    """The per-token work outside the blocks, on the device that holds the lm_head."""
    device: str
    tail_ms: tuple[float, ...]
    crossing_ms: tuple[float, ...] = ()   # GPU: hidden state + RoPE rows host -> device, synchronised

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.tail_ms)

    @property
    def crossing_p50_ms(self) -> float:
        return statistics.median(self.crossing_ms) if self.crossing_ms else 0.0


@dataclass(frozen=True)
class BundleTimings:
    bundle_dir: str
    plan: Plan
    spec: ModelSpec
    weights: str                    # where the bound weights came from
    stages: tuple[StageTiming, ...]
    tails: tuple[TailTiming, ...]
    steps: int                      # timed steps per part

    def stage(self, device: str) -> Optional[StageTiming]:
        return next((s for s in self.stages if s.device == device), None)

    def tail(self, device: str) -> Optional[TailTiming]:
        return next((t for t in self.tails if t.device == device), None)


def plan_parts(plan: Plan) -> tuple[str, ...]:
    """What a bundle's plan lets calibration time: the devices holding blocks, and the head's device."""
    out = []
    if len(plan.placement.cpu_layers):
        out.append("cpu_blocks")
    if len(plan.placement.gpu_layers) and plan.placement.uses_gpu:
        out.append("gpu_blocks")
    out.append("gpu_head" if plan.placement.head_on_gpu else "cpu_head")
    return tuple(out)


def load_bundle_parts(bundle_dir: str, weights_dir: str | None = None, trusted_keys: tuple | None = None,
                      require_signed: bool = False) -> tuple[ModelSpec, Plan, Checkpoint, str]:
    """Spec, plan and checkpoint of a verified bundle (verification, signature first, before any library loads)."""
    return _verified_parts(bundle_dir, weights_dir, trusted_keys, require_signed)[1:]


def _verified_parts(bundle_dir, weights_dir, trusted_keys, require_signed):
    """(manifest, spec, plan, checkpoint, weights path): the manifest is what the libraries load against."""
    from helmc.runtime.session import read_bundle
    manifest, spec, plan, wdir = read_bundle(bundle_dir, weights_dir, trusted_keys, require_signed)
    if not os.path.exists(wdir):
        raise HelmcError(f"calibrate: expected the model's weights (a directory or a GGUF file), found nothing at "
                         f"{wdir} (pass --weights MODEL_DIR)")
    return manifest, spec, plan, open_checkpoint(wdir, spec), wdir


def measure_bundle(bundle_dir: str, weights_dir: str | None = None, parts: tuple[str, ...] | None = None,
                   steps: int | None = None, warmup: int = 5, cpu_cache_bytes: int = 0, trusted_keys: tuple | None = None,
                   require_signed: bool = False, cuda_graph: bool = True) -> BundleTimings:
    """Time `parts` (default: all the plan uses, see plan_parts) of the bundle's decode step here.

    steps: timed decode steps per part (default: the plan's output_len); cpu_cache_bytes: the CPU's
    last-level cache, so the cycled CPU blocks are at least twice its size; cuda_graph: the GPU blocks' step
    replayed as one CUDA graph, as the session decodes (False: eager launches)."""
    manifest, spec, plan, ck, wdir = _verified_parts(bundle_dir, weights_dir, trusted_keys, require_signed)
    usable = plan_parts(plan)
    parts = usable if parts is None else tuple(parts)
    unknown = [p for p in parts if p not in usable]
    if unknown:
        raise HelmcError(f"calibrate: parts expected among those the plan {plan.describe()} uses {list(usable)}, "
                         f"found {unknown}")
    steps = plan.workload.output_len if steps is None else steps
    if steps < 1 or warmup < 0:
        raise HelmcError(f"calibrate: steps expected >= 1 and warmup >= 0, found {steps}, {warmup}")
    mean_context = plan.workload.prompt_len + plan.workload.output_len / 2          # cost_model.Workload.decode_context
    first = max(0, int(round(mean_context - (steps + 1) / 2)))
    fill = max(0, first - warmup)
    total = fill + warmup + steps
    if total > plan.memory.max_context:
        raise HelmcError(f"calibrate: {total} tokens of context needed, the plan allows {plan.memory.max_context}")
    ctx = _Context(bundle_dir, manifest, spec, plan, ck, fill, warmup, steps, cpu_cache_bytes, cuda_graph)
    stages, tails = [], []
    if "cpu_blocks" in parts or "cpu_head" in parts:
        cpu = _CpuSide(ctx)
        if "cpu_blocks" in parts:
            stages.append(cpu.time_blocks())
        if "cpu_head" in parts:
            tails.append(cpu.time_tail())
        cpu.close()
    if "gpu_blocks" in parts or "gpu_head" in parts:
        gpu = _GpuSide(ctx)
        if "gpu_blocks" in parts:
            stages.append(gpu.time_blocks())
        if "gpu_head" in parts:
            tails.append(gpu.time_tail())
        gpu.close()
    return BundleTimings(bundle_dir, plan, spec, f"checkpoint {wdir}", tuple(stages), tuple(tails), steps)


# ------------------------------------------------------------------------------------------------
class _Context:
    """What both devices' timers share: the bundle, the step schedule, host-side inputs."""

    def __init__(self, bundle_dir: str, manifest, spec: ModelSpec, plan: Plan, ck: Checkpoint, fill: int, warmup: int,
                 steps: int, cpu_cache_bytes: int, cuda_graph: bool = True):
        self.bundle_dir, self.manifest, self.spec, self.plan, self.ck = bundle_dir, manifest, spec, plan, ck
        self.cuda_graph = cuda_graph
        self.fill, self.warmup, self.steps = fill, warmup, steps
        self.total = fill + warmup + steps
        self.cpu_cache_bytes = cpu_cache_bytes
        self.rope = rope_tables(spec)
        self.embed_rows = Embedding(ck, spec)
        self.rng = np.random.default_rng(0)
        self.token = int(self.rng.integers(3, spec.vocab_size))
        self.sampler = Sampler(SamplingParams(0.0))
        self.block_bytes = max(spec.block_weight_bytes(i) for i in range(spec.num_layers))   # as stored

    def embed(self, token: int) -> np.ndarray:
        """As Session.embed: one row gathered from the mmapped checkpoint, float32 [1, H]."""
        return self.embed_rows(np.array([token]))

    def distinct(self, blocks: int, cache_bytes: int) -> int:
        return distinct_blocks(blocks, cache_bytes, self.block_bytes, self.spec.num_layers)

    def random_kv(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        shape = (self.fill, self.spec.num_kv_heads, self.spec.head_dim)          # [S, h_kv, d]
        return ((0.1 * self.rng.standard_normal(shape)).astype(dtype),
                (0.1 * self.rng.standard_normal(shape)).astype(dtype))

    def run(self, step) -> tuple[float, ...]:
        """warmup + steps calls of step(position) -> ms; the timed ones."""
        times = []
        for i in range(self.warmup + self.steps):
            ms = step(self.fill + i)
            if i >= self.warmup:
                times.append(ms)
        return tuple(times)


def distinct_blocks(blocks: int, cache_bytes: int, block_bytes: int, num_layers: int) -> int:
    """Blocks of distinct weights a timed step cycles over: twice the cache's bytes, never fewer than two."""
    want = max(MIN_DISTINCT_BLOCKS, -(-2 * cache_bytes // max(1, block_bytes)))
    return max(1, min(blocks, want, num_layers))


def _sinks(ck, spec, layers, m: int):
    """The attention sinks of m cache layers over the distinct blocks `layers` (None without sinks)."""
    from helmc.runtime.weights.bind import layer_sinks
    sinks = layer_sinks(ck, spec, layers)
    return None if sinks is None else tuple(sinks[i % len(sinks)] for i in range(m))


def _source_layers(plan_layers: range, n: int) -> range:
    """The checkpoint blocks whose weights are bound: the first n the plan puts on this device."""
    return range(plan_layers.start, plan_layers.start + n)


class _CpuSide:
    def __init__(self, ctx: _Context):
        import tvm.runtime

        from helmc.runtime.cpu_stage import CPU_STAGE_LIB, load_stage_library
        from helmc.runtime.tvm_tensors import available_cpu_count, use_cpu_threads

        self.ctx = ctx
        use_cpu_threads(available_cpu_count())     # as the session: TVM otherwise uses half the cores on x86
        self.dev = tvm.cpu()
        self.vm = load_stage_library(ctx.bundle_dir, ctx.manifest, CPU_STAGE_LIB)

    def tensor(self, a: np.ndarray):
        import tvm.runtime
        return tvm.runtime.tensor(np.ascontiguousarray(a), self.dev)

    def time_blocks(self) -> StageTiming:
        from helmc.runtime.kv.cache_cpu import KVCacheCPU, find_decode_kernel
        from helmc.runtime.stage import Stage
        from helmc.runtime.weights.bind import bind_layers

        ctx, spec = self.ctx, self.ctx.spec
        m = len(ctx.plan.placement.cpu_layers)
        n = ctx.distinct(m, ctx.cpu_cache_bytes)
        layers = _source_layers(ctx.plan.placement.cpu_layers, n)
        arenas = None
        if getattr(ctx.plan, "prefill_on_gpu", False):    # as the session: weights in pinned arenas (streamed prefill)
            from helmc.runtime.prefill_stream import bind_pinned_layers
            bound, arenas = bind_pinned_layers(ctx.ck, spec, layers)
        else:
            bound = bind_layers(ctx.ck, spec, layers, self.dev)
        kv = KVCacheCPU(num_layers=m, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                        page_tokens=KV_PAGE_TOKENS, max_tokens=ctx.total, dtype=spec.dtype,
                        sliding_window=spec.sliding_window or None, sinks=_sinks(ctx.ck, spec, layers, m),
                        attend_kernel=find_decode_kernel(self.vm.module, spec.num_heads, spec.num_kv_heads,
                                                         spec.head_dim, spec.dtype))
        stage = Stage("cpu", self.vm, spec, range(m), kv, [bound[i % n] for i in range(m)],
                      to_array=lambda t: t.numpy(), from_array=self.tensor)
        if ctx.fill:
            k, v = ctx.random_kv(np.float32)
            for layer in range(m):
                kv.append(layer, k, v)
            kv.advance(ctx.fill)
        x = ctx.embed(ctx.token)

        def step(pos: int) -> float:
            cos, sin = ctx.rope.cos_sin(np.array([pos]))                   # [1, D] each
            t0 = time.perf_counter()
            # As the session's CPU step: wrap the inputs, run every block, hand the result over as NumPy.
            stage.forward(self.tensor(x), self.tensor(cos), self.tensor(sin), "decode").numpy()
            return 1e3 * (time.perf_counter() - t0)

        times = ctx.run(step)
        kv.close()
        del arenas                                          # held until the timed steps are done
        return StageTiming("cpu", m, n, ctx.fill + ctx.warmup, times)

    def time_tail(self) -> TailTiming:
        from helmc.runtime.weights.bind import bind_head

        ctx = self.ctx
        head_w = bind_head(ctx.ck, ctx.spec, self.dev)
        head = self.vm["head_decode"]

        def step(pos: int) -> float:
            t0 = time.perf_counter()
            ctx.rope.cos_sin(np.array([pos]))
            x = ctx.embed(ctx.token)
            # The head's input stands in for the stage's output (wrapping x, cos, sin is timed with the blocks).
            logits = head(self.tensor(x), *head_w).numpy()                  # [1, V] float32
            ctx.sampler(logits[-1])
            return 1e3 * (time.perf_counter() - t0)

        return TailTiming("cpu", ctx.run(step))

    def close(self):
        self.vm = None


class _GpuSide:
    def __init__(self, ctx: _Context):
        import cupy as cp
        import tvm.runtime
        from tvm.runtime.vm import VirtualMachine

        from helmc.runtime.bundle.library import verified_library
        from helmc.runtime.cuda_runtime import PinnedUploader, load_gpu_executable
        from helmc.runtime.gpu_session import GPU_CUBIN_INDEX, GPU_LIB

        self.ctx, self.cp = ctx, cp
        # Loading the executable first registers TVM's CUDA backend (runtime-only TVM loads none).
        with verified_library(ctx.bundle_dir, ctx.manifest, GPU_LIB) as path:
            lib = load_gpu_executable(path, os.path.join(ctx.bundle_dir, GPU_CUBIN_INDEX))
        self.dev = tvm.cuda(0)
        self.vm = VirtualMachine(lib, self.dev)
        self.uploader = PinnedUploader()

    def upload(self, view, dtype, dev):
        return self.uploader.upload(view, dtype, dev)

    def sync(self):
        self.cp.cuda.Device().synchronize()

    def time_blocks(self) -> StageTiming:
        from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_to_cupy
        from helmc.runtime.kv.cache_gpu import KVCacheGPU
        from helmc.runtime.kv.cuda_ops import bundle_cuda_ops
        from helmc.runtime.stage import Stage
        from helmc.runtime.weights.bind import bind_layers

        cp, ctx, spec = self.cp, self.ctx, self.ctx.spec
        m = len(ctx.plan.placement.gpu_layers)
        n = ctx.distinct(m, 0)
        bound = bind_layers(ctx.ck, spec, _source_layers(ctx.plan.placement.gpu_layers, n), self.dev, to_device=self.upload)
        self.uploader.synchronize()
        pages = -(-ctx.total // KV_PAGE_TOKENS)
        # Every page stays resident, as in the benchmark's short requests (the plan's VRAM holds them).
        kv = KVCacheGPU(m, spec.num_kv_heads, spec.head_dim, page_tokens=KV_PAGE_TOKENS, max_tokens=ctx.total,
                        gpu_pages=pages + 2, offload=ctx.plan.workload.kv_offload, sliding_window=spec.sliding_window or None,
                        ops=bundle_cuda_ops(ctx.bundle_dir, spec.head_dim, spec.group_size),
                        sinks=_sinks(ctx.ck, spec, _source_layers(ctx.plan.placement.gpu_layers, n), m))
        stage = Stage("gpu", self.vm, spec, range(m), kv, [bound[i % n] for i in range(m)],
                      to_array=tvm_to_cupy, from_array=cupy_to_tvm)
        if ctx.fill:
            k, v = (cp.asarray(a) for a in ctx.random_kv(np.float16))
            for layer in range(m):
                kv.append(layer, k, v)
            kv.advance(ctx.fill)
        xg = cp.asarray(ctx.embed(ctx.token)).astype(cp.float16)          # [1, H] on the GPU, as the session's
        cos, sin = (cp.asarray(a) for a in ctx.rope.cos_sin(np.array([ctx.fill])))
        self.sync()
        # Two steps of KV room at least: the eager step before the capture and the captured one.
        graphed = self.ctx.cuda_graph and ctx.warmup + ctx.steps >= 2
        times = self._graph_steps(stage, kv, xg, cos, sin) if graphed else None
        if times is None:
            def step(pos: int) -> float:
                t0 = time.perf_counter()
                stage.forward(cupy_to_tvm(xg), cupy_to_tvm(cos), cupy_to_tvm(sin), "decode")
                self.sync()                                                    # the step's blocks, done on the device
                return 1e3 * (time.perf_counter() - t0)

            times = ctx.run(step)
        kv.reset()
        return StageTiming("gpu", m, n, ctx.fill + ctx.warmup, times)

    def _graph_steps(self, stage, kv, xg, cos, sin) -> tuple[float, ...] | None:
        """The decode step's blocks as the session runs them (decode_graph.DecodeGraph): one eager step, then the
        next step captured once as a CUDA graph and replayed, each replay timed to its end on the device. Eager
        launches from Python cost ~0.09 ms per block on an H100 where the graph's replay costs a few
        microseconds, so a fit on eager steps made the all-GPU plan 1.34x the measured token. Replays rewrite the
        same KV row: the attention context stays at the first step's. None (eager timing) if the capture fails."""
        from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_stream

        cp, spec = self.cp, self.ctx.spec
        stream = cp.cuda.Stream(non_blocking=True)
        attn = cp.empty((1, spec.q_dim), cp.float16)
        views = [cupy_to_tvm(a) for a in (xg, cos, sin, attn)]
        with stream, tvm_stream(stream):
            x, c, s, a = views
            kv.begin_step(1)
            stage.run_blocks(x, c, s, "decode", attn_out=(attn, a))
            kv.advance(1)
            kv.begin_step(1)
            pool = cp.cuda.MemoryPool()
            try:
                with cp.cuda.using_allocator(pool.malloc):
                    stream.begin_capture()
                    try:
                        stage.run_blocks(x, c, s, "decode", attn_out=(attn, a))
                    finally:
                        graph = stream.end_capture()
            except Exception:            # as DecodeGraph: a failed capture enqueued nothing; time eager steps
                kv.forget_appends()
                stream.synchronize()
                return None

            def step(pos: int) -> float:
                t0 = time.perf_counter()
                graph.launch(stream)
                stream.synchronize()
                return 1e3 * (time.perf_counter() - t0)

            times = self.ctx.run(step)
            kv.advance(1)
            stream.synchronize()
        del graph, pool
        return times

    def time_tail(self) -> TailTiming:
        from helmc.runtime.cuda_runtime import cupy_to_tvm, tvm_to_cupy
        from helmc.runtime.weights.bind import bind_head

        cp, ctx = self.cp, self.ctx
        head_w = bind_head(ctx.ck, ctx.spec, self.dev, to_device=self.upload)
        self.uploader.synchronize()
        head = self.vm["head_decode"]

        def crossing(pos: int):
            cos, sin = ctx.rope.cos_sin(np.array([pos]))
            x = ctx.embed(ctx.token)
            # As GpuParts.forward: the one hidden-state copy (cast on the GPU) and the RoPE rows.
            return cp.asarray(x).astype(cp.float16), cp.asarray(cos), cp.asarray(sin)

        def step(pos: int) -> float:
            t0 = time.perf_counter()
            xg, cos, sin = crossing(pos)
            cupy_to_tvm(cos), cupy_to_tvm(sin)
            logits = head(cupy_to_tvm(cp.ascontiguousarray(xg)), *head_w)
            ctx.sampler(cp.asnumpy(tvm_to_cupy(logits))[-1])              # [1, V] float32 back to the host
            return 1e3 * (time.perf_counter() - t0)

        def step_crossing(pos: int) -> float:
            t0 = time.perf_counter()
            crossing(pos)
            self.sync()
            return 1e3 * (time.perf_counter() - t0)

        tail = ctx.run(step)
        return TailTiming("gpu", tail, ctx.run(step_crossing))

    def close(self):
        self.uploader.close()
        self.vm = None
        self.cp.get_default_memory_pool().free_all_blocks()
