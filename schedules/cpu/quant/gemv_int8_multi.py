"""One-token decode GEMVs over 2 or 3 int8-path weights (Q4_K, Q6_K, Q4_0) of one type and K that read the same x, as one kernel call.

Why (as gemv_fused.py does for the fp16 stage): a Q4_K block's q/k/v and gate/up were five
calls, each quantizing x to int8 on one core before its parallel loop. Here x is quantized once and each weight's
rows run in a parallel loop of their own, one after the other, by the one-weight kernel's own step
(gemv_int8.one_token_step), so y_i is bit-identical to that kernel's; no weight is repacked.
One parallel loop over every weight's steps (as gemv_fused does for fp16) ran slower than the separate kernels
(2-core EPYC, Q4_K q/k/v of 4096, 1024 and 1024 rows x 4096: 496 against 354 us; each weight's step in a branch
of an if chain, the Q4_K step's unrolled rows and constants three times over in one loop body). A loop per weight,
four alternating rounds of 8 weight copies x 10 passes on the same machine: q/k/v 377-417 us against 400-436 for
the three kernels (-4%), gate/up (12288 x 4096 each) 1656-1757 against 1729-1807 (-3%).

  make_gemv_quant_int8_multi(qtype, (n_q, n_k, n_v), k, isa) -> PrimFunc(x, w_0.., y_0..): y_i = x @ dequant(w_i)^T
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.schedules.cpu.gemv_quant import DEFAULT_TUNING, QuantGemvTuning, _check, quant_blocking
from helmc.schedules.cpu.isa import VectorIsa
from helmc.schedules.cpu.quant.gemv_int8 import INT8_TUNING, INT8_UNITS, _macros, int8_gemv_applies, one_token_step

QUANT_MULTI_MAX_WEIGHTS = 3


def quant_gemvs_fuse(qtype: str, isa: VectorIsa, m: int | None, k: int) -> bool:
    """Whether the CPU stage runs one decode step's `qtype` GEMVs that read the same x of K = k as one launch
    (lower_linear's "qmulti"; the profile kit times the launches the stage makes): one token on the int8 path."""
    return m == 1 and int8_gemv_applies(qtype, isa, k)


def gemv_quant_multi_symbol(qtype: str, ns: tuple[int, ...], k: int) -> str:
    return f"helmc_gemv{len(ns)}_{qtype}_n{'_'.join(map(str, ns))}_k{k}"


def make_gemv_quant_int8_multi(qtype: str, ns: tuple[int, ...], k: int, isa: VectorIsa,
                               tuning: QuantGemvTuning = DEFAULT_TUNING) -> tirx.PrimFunc:
    for n in ns:
        _check(qtype, n, k)
    assert int8_gemv_applies(qtype, isa, k), (qtype, isa.tier, k)
    assert 2 <= len(ns) <= QUANT_MULTI_MAX_WEIGHTS, ns
    tuning = INT8_TUNING[qtype] if tuning == DEFAULT_TUNING else tuning
    unit = INT8_UNITS[qtype]
    rows, _ = quant_blocking(qtype, 1, isa, tuning)
    blocks = k // unit.weights
    row_bytes = blocks * unit.bytes
    quantize, _ = _macros(qtype, isa, 1, 1)
    steps = [-(-n // rows) for n in ns]
    runs = [one_token_step(qtype, n, k, isa, tuning) for n in ns]
    name = gemv_quant_multi_symbol(qtype, tuple(ns), k)
    dx_len, xs_len, xs_dtype = blocks * unit.dx_lanes, blocks * unit.sums, unit.xs_dtype
    n0, n1 = ns[0], ns[1]
    s0 = steps[0]
    run0, run1 = runs[0], runs[1]

    if len(ns) == 2:
        @T.prim_func
        def gemv2(x: T.Buffer((1, k), "float32"), w0: T.Buffer((n0, row_bytes), "uint8"),
                  w1: T.Buffer((n1, row_bytes), "uint8"), y0: T.Buffer((1, n0), "float32"),
                  y1: T.Buffer((1, n1), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            wi0 = T.decl_buffer((n0, row_bytes), "int8", data=w0.data)
            wh0 = T.decl_buffer((n0, row_bytes // 2), "float16", data=w0.data)
            wf0 = T.decl_buffer((n0 * row_bytes,), "uint8", data=w0.data)
            wu0 = T.decl_buffer((n0, row_bytes // 4), "uint32", data=w0.data)
            wi1 = T.decl_buffer((n1, row_bytes), "int8", data=w1.data)
            wh1 = T.decl_buffer((n1, row_bytes // 2), "float16", data=w1.data)
            wf1 = T.decl_buffer((n1 * row_bytes,), "uint8", data=w1.data)
            wu1 = T.decl_buffer((n1, row_bytes // 4), "uint32", data=w1.data)
            xq = T.alloc_buffer((1, k), "int8")
            dx = T.alloc_buffer((1, dx_len), "float32")
            xs = T.alloc_buffer((1, xs_len), xs_dtype)
            for b in T.serial(blocks):
                quantize(x, xq, dx, xs, 0, b)
            for step in T.parallel(s0):
                run0(w0, wi0, wh0, wf0, wu0, xq, dx, xs, y0, step)
            for step in T.parallel(steps[1]):
                run1(w1, wi1, wh1, wf1, wu1, xq, dx, xs, y1, step)

        return gemv2.with_attr("global_symbol", name)

    n2, run2 = ns[2], runs[2]

    @T.prim_func
    def gemv3(x: T.Buffer((1, k), "float32"), w0: T.Buffer((n0, row_bytes), "uint8"),
              w1: T.Buffer((n1, row_bytes), "uint8"), w2: T.Buffer((n2, row_bytes), "uint8"),
              y0: T.Buffer((1, n0), "float32"), y1: T.Buffer((1, n1), "float32"), y2: T.Buffer((1, n2), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        wi0 = T.decl_buffer((n0, row_bytes), "int8", data=w0.data)
        wh0 = T.decl_buffer((n0, row_bytes // 2), "float16", data=w0.data)
        wf0 = T.decl_buffer((n0 * row_bytes,), "uint8", data=w0.data)
        wu0 = T.decl_buffer((n0, row_bytes // 4), "uint32", data=w0.data)
        wi1 = T.decl_buffer((n1, row_bytes), "int8", data=w1.data)
        wh1 = T.decl_buffer((n1, row_bytes // 2), "float16", data=w1.data)
        wf1 = T.decl_buffer((n1 * row_bytes,), "uint8", data=w1.data)
        wu1 = T.decl_buffer((n1, row_bytes // 4), "uint32", data=w1.data)
        wi2 = T.decl_buffer((n2, row_bytes), "int8", data=w2.data)
        wh2 = T.decl_buffer((n2, row_bytes // 2), "float16", data=w2.data)
        wf2 = T.decl_buffer((n2 * row_bytes,), "uint8", data=w2.data)
        wu2 = T.decl_buffer((n2, row_bytes // 4), "uint32", data=w2.data)
        xq = T.alloc_buffer((1, k), "int8")
        dx = T.alloc_buffer((1, dx_len), "float32")
        xs = T.alloc_buffer((1, xs_len), xs_dtype)
        for b in T.serial(blocks):
            quantize(x, xq, dx, xs, 0, b)
        for step in T.parallel(s0):
            run0(w0, wi0, wh0, wf0, wu0, xq, dx, xs, y0, step)
        for step in T.parallel(steps[1]):
            run1(w1, wi1, wh1, wf1, wu1, xq, dx, xs, y1, step)
        for step in T.parallel(steps[2]):
            run2(w2, wi2, wh2, wf2, wu2, xq, dx, xs, y2, step)

    return gemv3.with_attr("global_symbol", name)
