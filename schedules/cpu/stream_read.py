"""The DRAM ceiling the CPU stage is judged against: a parallel, vectorised read (sum) of a large fp32 buffer.

Same code generator, threads and vector width as the linear kernels, so "GEMV GB/s / read GB/s" isolates
how close the GEMV gets to what the memory system delivers (thesis 4.1.5's roofline validation).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.isa import VectorIsa

READ_TASKS = 1024   # parallel chunks; many more than cores so the static split stays balanced


def stream_read_elements(min_bytes: int, isa: VectorIsa) -> int:
    """fp32 element count >= min_bytes / 4 that divides evenly into tasks x chunk."""
    quantum = READ_TASKS * isa.fp32_lanes * 4
    elements = -(-min_bytes // 4)
    return -(-elements // quantum) * quantum


def make_stream_read(elements: int, isa: VectorIsa) -> tirx.PrimFunc:
    """partial[t] = sum of slice t of `a`; the caller times it and divides 4 * elements by the time."""
    chunk = isa.fp32_lanes * 4
    per_task = elements // READ_TASKS
    assert per_task * READ_TASKS == elements and per_task % chunk == 0, (elements, chunk)

    @T.prim_func
    def stream_read(a: T.Buffer((elements,), "float32"), partial: T.Buffer((READ_TASKS,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for task in T.parallel(READ_TASKS):
            acc = T.alloc_buffer((chunk,), "float32", scope="local")
            for v in T.vectorized(chunk):
                acc[v] = T.float32(0)
            for i in T.serial(per_task // chunk):
                for v in T.vectorized(chunk):
                    acc[v] = acc[v] + a[task * per_task + i * chunk + v]
            total = T.alloc_buffer((1,), "float32", scope="local")
            total[0] = T.float32(0)
            for v in T.unroll(chunk):
                total[0] = total[0] + acc[v]
            partial[task] = total[0]

    return stream_read.with_attr("global_symbol", "helmc_stream_read")
