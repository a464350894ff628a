"""A hybrid plan's decode, put together from the pieces runtime/gpu_session.load_gpu_parts loads: the pinned
arenas of the host-resident blocks (the streamed prefill's), the CPU stage over the CPU groups, the GPU cache
(streamed blocks first, then the resident ones), the resident stage with its decode graph, and the head."""
from __future__ import annotations

from helmc.errors import HelmcError
from helmc.runtime.hybrid.schedule import HybridSchedule, schedule_of


def allocate_ring(plan, arenas: list) -> tuple[HybridSchedule, object]:
    """The plan's schedule with each streamed block's slot sized by its arena, and the ring (device uint8)."""
    import cupy as cp

    by_layer = {a.layer: a for a in arenas}
    missing = [i for i in plan.placement.streamed_layers if i not in by_layer]
    if missing:
        raise HelmcError(f"hybrid decode: streamed blocks {missing} expected in pinned arenas, found none")
    schedule = schedule_of(plan, lambda layer: by_layer[layer].nbytes)
    return schedule, cp.empty((schedule.ring_bytes,), cp.uint8)


def ring_lender(ring):
    """lend(nbytes) over the staging ring for the streamed prefill (StreamedPrefill.lend): its first nbytes, or
    None when the ring is smaller (the prefill then allocates its own). Safe between decode steps: a step's
    copies into the ring are all waited for by its groups, and the step ends with the host waiting for the
    compute stream (the logits), so nothing reads or writes the ring then; the prefill's kernels run on that
    stream and it ends the same way (its hidden state back to the host) before the next step's first copy is
    issued."""
    return lambda nbytes: ring[:nbytes] if nbytes <= ring.nbytes else None


def prefill_kv_targets(schedule: HybridSchedule, arenas: list) -> tuple[tuple[str, int], ...]:
    """Where the streamed prefill puts each host-resident block's K, V: its CPU-cache layer for a CPU group's
    block, its GPU-cache layer for a streamed block (decode attends them there)."""
    cpu, gpu = schedule.cpu_layers, schedule.gpu_kv_layers
    return tuple(("gpu", gpu.index(a.layer)) if a.layer in gpu else ("cpu", cpu.index(a.layer)) for a in arenas)


def ring_bindings(ring, arena, offset: int, spec, to_tvm):
    """TVM tensors of one streamed block's parameters, viewing its ring slot (the arena's layout)."""
    from helmc.runtime.prefill_stream import binding_of, slot_views

    region = ring[offset:offset + arena.nbytes]
    return binding_of([to_tvm(v, "bfloat16" if s.dtype == "bfloat16" else None)
                       for s, v in zip(arena.slots, slot_views(region, arena.slots))], spec)


def hybrid_decode(schedule: HybridSchedule, ring, arenas: list, vm, spec, cpu_stage, stage, graph, head_fns,
                  head_weights, to_tvm, to_cupy):
    """HybridDecode over CudaHybridBackend: one Stage per streamed group (the GPU's compiled block functions, its
    blocks' parameters on the ring), the resident part through `graph` (DecodeGraph) or eagerly without one; with
    `graph`, each streamed group as a CUDA graph of its own too (group_graph.py), on the same stream."""
    import cupy as cp

    from helmc.runtime.hybrid.cuda_backend import CudaHybridBackend
    from helmc.runtime.hybrid.executor import HybridDecode
    from helmc.runtime.stage import Stage

    if cpu_stage is None or stage is None:
        raise HelmcError("hybrid decode: expected a CPU stage and a GPU cache, found "
                         f"{'no CPU stage' if cpu_stage is None else 'no GPU cache'}")
    by_layer = {a.layer: a for a in arenas}
    streamed = []
    for p in schedule.pairs:
        bindings = [ring_bindings(ring, by_layer[s.layer], s.offset, spec, to_tvm) for s in p.slots]
        layers = range(p.slots[0].layer, p.slots[-1].layer + 1)
        streamed.append(Stage(f"streamed{p.index}", vm, spec, layers, stage.kv, bindings, to_array=to_cupy,
                              from_array=to_tvm, batch_sizes=stage.batch_sizes, kv_base=p.gpu_kv_base,
                              gpu_decode_batch=stage.shared_gpu_decode_batch()))   # one step table for every stage

    if graph is not None:
        def resident(x, cos, sin):
            return graph.step(x, cos, sin, begun=True)
    else:
        def resident(x, cos, sin):
            xt = stage.run_blocks(to_tvm(cp.ascontiguousarray(x)), to_tvm(cp.asarray(cos)), to_tvm(cp.asarray(sin)),
                                  "decode")
            stage.kv.advance(1)
            return cp.asnumpy(to_cupy(head_fns["decode"](xt, *head_weights)))

    backend = CudaHybridBackend(schedule, {i: by_layer[i] for i in schedule.streamed_layers}, ring, streamed,
                                cpu_stage, stage.kv, resident, spec, to_tvm, to_cupy,
                                graph_stream=graph.stream if graph is not None else None)
    return HybridDecode(schedule, backend)
