"""Decode GEMV of the GPU stage over fp16 / bf16 weights (scheduled TIR): y[m, n] = x[m, k] @ W[n, k]^T.

x and y are fp16 (the GPU stage's activations), W is stored fp16 or bf16 in HF layout [N, K]; products and sums
are fp32 and y is rounded to fp16 once, at the end: what the stage's other matmuls compute
(compile_gpu_stage.rewrite_matmuls_fp32_accumulate). m is the step's static row count: 1 for a decode step,
B for a batched decode step of B sequences (import_relax's decode_b{B} variants), and every weight is read once
per call whatever m is.

Work split: a thread block owns `rows_per_warp` consecutive rows of W, and its `warps` warps split k: warp w takes
steps w, w + warps, ...; in step s lane l reads VEC = 8 consecutive weights (one 16-byte load) at k = 256 s + 8 l,
so a warp reads 512 contiguous bytes of each row per step; `unroll` steps are loaded before any is used, so each
warp has unroll x rows 16-byte loads in flight. A row's k is so walked by warps x 32 lanes at once (a warp owning
whole rows was 12-20% slower at Qwen3-8B's shapes: one long chain of loads per row). The lanes' partial sums meet
in a 5-step butterfly of warp shuffles, the warps' through shared memory, added in warp order. x (16-byte loads
too) comes from L1/L2; rows_per_warp > 1 divides that traffic (it matters at large m).

Batch invariance: y[t, j] is formed the same way for every m, rows_per_warp, warps and unroll --
lane l of warp w sums x[t, k] * W[j, k] over its k in step order (8 FMAs a step, in k order), the 32 lane sums
meet in the same butterfly, the warps' sums are added in warp order -- so row t of an m-row call is bit-identical to a 1-row call on x[t] alone. The only
choices left to nvcc (FMA contraction of the same expression) are the same for every (t, j).

Loads go through uint32 views (two 16-bit values per word, widened exactly: fp16 by the hardware convert of
its bits, bf16 by a shift), so no 16-bit vector type of TVM's CUDA code generator is involved. k must be a
multiple of 8 and x, W, y 16-byte aligned (TVM and CuPy allocations are; rows are, as k % 8 == 0).

One launch, several outputs (a decode step's graph nodes cost ~1 us each beside the GEMVs' own time):
- several weights of one x (q, k, v; gate, up): n a tuple, PrimFunc(x, w0, w1[, w2], y0, y1[, y2]); each thread
  block works for one weight, so the small k / v projections ride on q's launch;
- epilogue "residual": PrimFunc(x, w, r, y), y = r + fp16(x @ w^T) added in fp16 (the block's residual add);
- epilogue "swiglu": PrimFunc(x, wg, wu, y), y = silu(g) * u of g = fp16(x @ wg^T), u = fp16(x @ wu^T) in fp16
  ops, the expression the stage's own elementwise kernel computes (T.sigmoid lowers as it does there); a thread
  block sums rows_per_warp rows of both weights.
Every row of y is summed as in the one-weight kernel (same lanes, steps, butterfly, warp order) and rounded to
fp16 at the same point, so the outputs are bit-identical to the separate launches'.

RMSNorm as a prologue (norm_eps; two norm launches a layer, ~4 us each, ahead of the GEMVs that read
their output): PrimFunc(x, g, w..., y...) computes y = fp16(inv * sum_k x[k] g[k] w[j, k]), inv = 1 / sqrt(mean(x^2)
+ eps): the block's warps read all of x anyway, so each lane also sums x^2 over its k (meeting in the same butterfly
and warp order, so every row of y of one x gets the same inv, whatever m). The normed x is never rounded to fp16
(the separate norm kernel rounds it): outputs agree with rms_norm-then-GEMV to fp16 rounding, not bit for bit, and
a one-row call is still bit-identical to a row of an m-row call. Forms: one weight, several weights, swiglu.
"""
from __future__ import annotations

import functools
import re
import struct

from tvm import tirx
from tvm.script import tirx as T

from helmc.errors import HelmcError

WARP = 32
VEC = 8                  # weights per lane per step: one 16-byte load
STEP = WARP * VEC        # weights of a row one warp covers per step
WEIGHT_DTYPES = ("float16", "bfloat16")
MAX_WEIGHTS = 3          # weights of one x one launch takes (q, k, v)
EPILOGUES = (None, "residual", "swiglu")
MAX_ROWS = 8             # largest m (runtime.stage.decode_batch_sizes stays within it at --max-batch <= 8)
_F32 = "float32"


# One-row tunings to use instead of default_tuning's, by epilogue (None, "residual", "swiglu"); empty: its own.
# Benchmarks may set it: the per-row bits depend on warps only, so a tuning that
# keeps warps = 4 keeps every output bit-identical and the m-row calls' rows equal to one-row calls.
M1_TUNING: dict = {}


def default_tuning(m: int, epilogue: str | None = None) -> tuple[int, int, int]:
    """(rows_per_warp, warps, unroll): one row of x: 2 rows per warp, 4 warps, 4 steps in flight; more rows of
    x: 4 rows per warp (each x load serves 4 rows, see the module docstring) and 2 steps in flight, which keeps
    the m x 4 accumulators and the staged weights in registers. Per-row bits depend on warps only (the k split),
    so warps is the same for every m. swiglu sums rows of two weights per thread block: half the rows of each
    keeps the accumulators and loads in flight as they were."""
    if m == 1 and epilogue in M1_TUNING:
        return M1_TUNING[epilogue]
    if epilogue == "swiglu":
        return (1, 4, 4) if m == 1 else (2, 4, 2)
    return (2, 4, 4) if m == 1 else (4, 4, 2)


def gemv_symbol(m: int, n, k: int, weight_dtype: str, tuning: tuple[int, int, int] | None = None,
                epilogue: str | None = None, norm_eps: float | None = None) -> str:
    """The PrimFunc's global symbol (a tuning other than default_tuning(m) appended); its kernel is + "_kernel".
    n: the row count, or a tuple of them for one launch over several weights of one x (n4096_1024_1024);
    epilogue: None, "residual" or "swiglu" (make_gpu_gemv's)."""
    short = {"float16": "f16", "bfloat16": "bf16"}[weight_dtype]
    n = "_".join(map(str, n)) if isinstance(n, (tuple, list)) else n
    tail = "" if tuning is None or tuning == default_tuning(m, epilogue) else "_r{}w{}u{}".format(*tuning)
    kind = {None: "", "residual": "res_", "swiglu": "swiglu_"}[epilogue]
    if norm_eps is not None:            # the eps's float32 bits: a symbol names its constant exactly
        kind = f"norm{struct.unpack('<I', struct.pack('<f', norm_eps))[0]:08x}_" + kind
    return f"helmc_gpu_gemv_{kind}{short}_m{m}_n{n}_k{k}{tail}"


_SYMBOL = re.compile(r"^helmc_gpu_gemv_(res_|swiglu_)?(f16|bf16)_m(\d+)_n([\d_]+)_k(\d+)(?:_r(\d+)w(\d+)u(\d+))?$")


def parse_gemv_symbol(name: str) -> tuple | None:
    """gemv_symbol's arguments (m, n or row counts, k, weight dtype, tuning or None, epilogue) back from a symbol
    without the norm prologue; None for any other name. A later pass rebuilds a kernel it finds in a module."""
    found = _SYMBOL.match(name)
    if not found:
        return None
    kind, short, m, n, k, *tune = found.groups()
    ns = tuple(int(v) for v in n.split("_"))
    tuning = tuple(int(v) for v in tune) if tune[0] else None
    epilogue = {None: None, "res_": "residual", "swiglu_": "swiglu"}[kind]
    return int(m), ns if len(ns) > 1 else ns[0], int(k), {"f16": "float16", "bf16": "bfloat16"}[short], tuning, epilogue


def _check(m: int, n: int, k: int, weight_dtype: str, tuning: tuple[int, int, int]) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise HelmcError(f"GPU GEMV: weight dtype expected one of {WEIGHT_DTYPES}, found {weight_dtype!r}")
    if not 1 <= m <= MAX_ROWS or n < 1 or k < VEC or k % VEC:
        raise HelmcError(f"GPU GEMV: 1 <= m <= {MAX_ROWS}, n >= 1 and k a positive multiple of {VEC} expected, "
                         f"found m={m}, n={n}, k={k}")
    rows, warps, unroll = tuning
    if rows < 1 or unroll < 1 or not 1 <= warps <= 1024 // WARP or m * rows > WARP:
        raise HelmcError(f"GPU GEMV: rows_per_warp >= 1, unroll >= 1, 1 <= warps <= 32 expected, found {tuning}")
    if n * k >= 2 ** 31:
        raise HelmcError(f"GPU GEMV: n * k expected < 2^31 (int32 indexing), found n={n}, k={k}")


def _widen(word, half, weight_dtype: str):
    """fp32 of the 16-bit value in the low (half 0) or high (half 1) 16 bits of a uint32 word; half may be an
    unrolled loop's expression (constant once unrolled)."""
    bits = T.shift_right(word, T.Cast("uint32", half * 16))
    if weight_dtype == "bfloat16":      # bf16 is the top half of an fp32: exact
        return T.reinterpret(_F32, T.shift_left(bits, T.uint32(16)))
    return T.Cast(_F32, T.reinterpret("float16", T.Cast("uint16", T.bitwise_and(bits, T.uint32(0xFFFF)))))



def make_gpu_gemv(m: int, n, k: int, weight_dtype: str, tuning: tuple[int, int, int] | None = None,
                  epilogue: str | None = None, norm_eps: float | None = None) -> tirx.PrimFunc:
    """PrimFunc(x: float16[m, k], w: weight_dtype[n, k], y: float16[m, n]) with y = x @ w^T (fp32 sums).
    tuning: (rows_per_warp, warps, unroll), default default_tuning(m, epilogue). n a tuple of 2 or 3 row counts,
    or an epilogue: the one-launch forms of the module docstring. norm_eps: the RMSNorm prologue, g: float16[k]
    after x (not with the residual epilogue). Made once per process for each argument set (a PrimFunc is
    immutable; parsing one takes 0.2-0.9 s and a GPU stage's passes ask for the same kernels per decode function)."""
    return _make_gpu_gemv(m, tuple(n) if isinstance(n, (tuple, list)) else n, k, weight_dtype,
                          tuple(tuning or default_tuning(m, epilogue)), epilogue, norm_eps, default_tuning(m, epilogue))


@functools.lru_cache(maxsize=512)
def _make_gpu_gemv(m: int, n, k: int, weight_dtype: str, tuning: tuple[int, int, int], epilogue: str | None,
                   norm_eps: float | None, default: tuple[int, int, int]) -> tirx.PrimFunc:
    # `default` (today's default_tuning, which M1_TUNING can change) is in the key only: the symbol names a tuning
    # by whether it is the default, so a PrimFunc made under another default must not be reused
    outs = tuple(n) if isinstance(n, (tuple, list)) else (n,)
    if epilogue not in EPILOGUES or not 1 <= len(outs) <= MAX_WEIGHTS or (epilogue and len(outs) > 1) or (
            norm_eps is not None and (epilogue == "residual" or not norm_eps > 0)):
        raise HelmcError(f"GPU GEMV: 1 to {MAX_WEIGHTS} weights without an epilogue, or one of {EPILOGUES[1:]} "
                         f"over one row count, a norm prologue (eps > 0) but with the residual epilogue, expected, "
                         f"found n={n}, epilogue={epilogue!r}, norm_eps={norm_eps!r}")
    norm = norm_eps is not None
    for n_i in outs:
        _check(m, n_i, k, weight_dtype, tuning)
    rows, warps, unroll = tuning
    span = rows * (2 if epilogue == "swiglu" else 1)     # accumulator rows of a thread: gate's, then up's
    words = VEC // 2                                # uint32 words per lane per step and row
    kw = k // 2                                     # words per row
    steps = -(-k // STEP)
    outer = -(-steps // (warps * unroll))           # warp ty takes steps ty, ty + warps, ...; lanes past k skip
    grids = [-(-n_i // rows) for n_i in outs]

    @T.macro
    def load_rows(wv, n_rows, cta, wl, first, so, ty, tx):
        # The unroll steps' weights first (in flight together), clamped to the last row and the row's last 16
        # bytes for loads; their use below skips what is past n or k.
        for si in T.unroll(unroll):
            for r in T.unroll(rows):
                for v in T.vectorized(words):
                    wl[si, first + r, v] = wv[T.min(cta * rows + r, n_rows - 1) * kw + T.min(
                        (((so * unroll + si) * warps + ty) * STEP + tx * VEC) // 2, kw - words) + v]

    @T.macro
    def warp_sums(xv, gv, wv, wv_up, n_rows, cta, ty, tx, red, acc, wl, xl, xf, gl, ss, red_ss):
        """red[(t * span + r) * warps + w] = warp w's sum of accumulator row r for row t of x (with norm, of x * g,
        and red_ss[t * warps + w] its sum of x^2)."""
        for t in T.unroll(m):
            for r in T.unroll(span):
                acc[t, r] = T.float32(0)
            if norm:
                ss[t] = T.float32(0)
        for so in T.serial(outer):
            load_rows(wv, n_rows, cta, wl, 0, so, ty, tx)
            if epilogue == "swiglu":
                load_rows(wv_up, n_rows, cta, wl, rows, so, ty, tx)
            for si in T.unroll(unroll):
                if ((so * unroll + si) * warps + ty) * STEP + tx * VEC < k:
                    if norm:
                        for v in T.vectorized(words):
                            gl[v] = gv[(((so * unroll + si) * warps + ty) * STEP + tx * VEC) // 2 + v]
                    for t in T.unroll(m):
                        for v in T.vectorized(words):
                            xl[v] = xv[t * kw + (((so * unroll + si) * warps + ty) * STEP + tx * VEC) // 2 + v]
                        for e in T.unroll(VEC):
                            if norm:
                                ss[t] = ss[t] + _widen(xl[e // 2], e % 2, "float16") * _widen(xl[e // 2], e % 2,
                                                                                               "float16")
                                xf[e] = _widen(xl[e // 2], e % 2, "float16") * _widen(gl[e // 2], e % 2, "float16")
                            else:
                                xf[e] = _widen(xl[e // 2], e % 2, "float16")
                        for r in T.unroll(span):
                            for e in T.unroll(VEC):
                                acc[t, r] = acc[t, r] + xf[e] * _widen(wl[si, r, e // 2], e % 2, weight_dtype)
        for t in T.unroll(m):
            for r in T.unroll(span):
                for s in T.unroll(5):             # butterfly: every lane ends with the warp's sum
                    acc[t, r] = acc[t, r] + T.tvm_warp_shuffle_xor(
                        T.uint32(0xFFFFFFFF), acc[t, r], 16 >> s, WARP, WARP)
                if tx == 0:
                    red[(t * span + r) * warps + ty] = acc[t, r]
            if norm:
                for s in T.unroll(5):
                    ss[t] = ss[t] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), ss[t], 16 >> s, WARP, WARP)
                if tx == 0:
                    red_ss[t * warps + ty] = ss[t]
        T.tvm_storage_sync("shared")

    @T.macro
    def row_sum(red, base, tot):
        # the warps' sums of one row of y, added in warp order
        tot[0] = red[base]
        for v in T.unroll(warps - 1):
            tot[0] = tot[0] + red[base + v + 1]

    @T.macro
    def rows_of(xv, gv, wv, wv_up, res, y, n_rows, cta, ty, tx):
        """y[:, rows of thread block `cta`] for one weight of n_rows rows (with up's rows for swiglu)."""
        red = T.alloc_buffer((m * span * warps,), _F32, scope="shared")   # [m, span, warps]
        red_ss = T.alloc_buffer((m * warps,), _F32, scope="shared")       # [m, warps]: with norm
        acc = T.alloc_buffer((m, span), _F32, scope="local")
        ss = T.alloc_buffer((m,), _F32, scope="local")
        wl = T.alloc_buffer((unroll, span, words), "uint32", scope="local")
        xl = T.alloc_buffer((words,), "uint32", scope="local")
        gl = T.alloc_buffer((words,), "uint32", scope="local")
        xf = T.alloc_buffer((VEC,), _F32, scope="local")
        tot = T.alloc_buffer((1,), _F32, scope="local")
        inv = T.alloc_buffer((1,), _F32, scope="local")
        warp_sums(xv, gv, wv, wv_up, n_rows, cta, ty, tx, red, acc, wl, xl, xf, gl, ss, red_ss)
        # one thread per (t, r) writes y[t, row r]
        if ty == 0 and tx < m * rows and cta * rows + tx % rows < n_rows:
            if norm:                          # 1 / sqrt(mean(x^2) + eps) of row t of x
                row_sum(red_ss, (tx // rows) * warps, tot)
                inv[0] = T.float32(1) / T.sqrt(tot[0] / T.float32(k) + T.float32(norm_eps))
            if epilogue == "swiglu":
                gu = T.alloc_buffer((2,), "float16", scope="local")
                row_sum(red, ((tx // rows) * span + tx % rows) * warps, tot)
                if norm:
                    tot[0] = tot[0] * inv[0]
                gu[0] = T.Cast("float16", tot[0])
                row_sum(red, ((tx // rows) * span + rows + tx % rows) * warps, tot)
                if norm:
                    tot[0] = tot[0] * inv[0]
                gu[1] = T.Cast("float16", tot[0])
                y[tx // rows, cta * rows + tx % rows] = gu[0] * T.sigmoid(gu[0]) * gu[1]
            else:
                row_sum(red, tx * warps, tot)
                if epilogue == "residual":
                    y[tx // rows, cta * rows + tx % rows] = res[tx // rows, cta * rows + tx % rows] + T.Cast(
                        "float16", tot[0])
                else:
                    if norm:
                        tot[0] = tot[0] * inv[0]
                    y[tx // rows, cta * rows + tx % rows] = T.Cast("float16", tot[0])

    @T.macro
    def shared_x(xv, gv, wvs, ys, bx, ty, tx):
        # each thread block works for one weight (those of weight i follow those of weight i - 1): bx-uniform
        if len(outs) == 2:
            if bx < grids[0]:
                rows_of(xv, gv, wvs[0], None, None, ys[0], outs[0], bx, ty, tx)
            else:
                rows_of(xv, gv, wvs[1], None, None, ys[1], outs[1], bx - grids[0], ty, tx)
        else:
            if bx < grids[0]:
                rows_of(xv, gv, wvs[0], None, None, ys[0], outs[0], bx, ty, tx)
            elif bx < grids[0] + grids[1]:
                rows_of(xv, gv, wvs[1], None, None, ys[1], outs[1], bx - grids[0], ty, tx)
            else:
                rows_of(xv, gv, wvs[2], None, None, ys[2], outs[2], bx - grids[0] - grids[1], ty, tx)

    n0, grid, wd = outs[0], sum(grids), weight_dtype
    if norm:
        gemv = _norm_prim_func(m, outs, k, wd, epilogue, grid, warps, rows_of, shared_x)
    elif len(outs) == 1 and epilogue is None:
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w: T.Buffer((n0, k), wd), y: T.Buffer((m, n0), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            wv = T.decl_buffer((n0 * kw,), "uint32", data=w.data)     # [n, k] 16-bit -> [n * k / 2] words
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        rows_of(xv, None, wv, None, None, y, n0, bx, ty, tx)
    elif epilogue == "residual":
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w: T.Buffer((n0, k), wd), r: T.Buffer((m, n0), "float16"),
                 y: T.Buffer((m, n0), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            wv = T.decl_buffer((n0 * kw,), "uint32", data=w.data)     # [n, k] 16-bit -> [n * k / 2] words
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        rows_of(xv, None, wv, None, r, y, n0, bx, ty, tx)
    elif epilogue == "swiglu":
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), wg: T.Buffer((n0, k), wd), wu: T.Buffer((n0, k), wd),
                 y: T.Buffer((m, n0), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            gv = T.decl_buffer((n0 * kw,), "uint32", data=wg.data)    # [n, k] 16-bit -> [n * k / 2] words
            uv = T.decl_buffer((n0 * kw,), "uint32", data=wu.data)    # [n, k] 16-bit -> [n * k / 2] words
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        rows_of(xv, None, gv, uv, None, y, n0, bx, ty, tx)
    elif len(outs) == 2:
        n1 = outs[1]

        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w0: T.Buffer((n0, k), wd), w1: T.Buffer((n1, k), wd),
                 y0: T.Buffer((m, n0), "float16"), y1: T.Buffer((m, n1), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            wv0 = T.decl_buffer((n0 * kw,), "uint32", data=w0.data)   # [n_i, k] 16-bit -> [n_i * k / 2] words
            wv1 = T.decl_buffer((n1 * kw,), "uint32", data=w1.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        shared_x(xv, None, [wv0, wv1], [y0, y1], bx, ty, tx)
    else:
        n1, n2 = outs[1], outs[2]

        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), w0: T.Buffer((n0, k), wd), w1: T.Buffer((n1, k), wd),
                 w2: T.Buffer((n2, k), wd), y0: T.Buffer((m, n0), "float16"), y1: T.Buffer((m, n1), "float16"),
                 y2: T.Buffer((m, n2), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            wv0 = T.decl_buffer((n0 * kw,), "uint32", data=w0.data)   # [n_i, k] 16-bit -> [n_i * k / 2] words
            wv1 = T.decl_buffer((n1 * kw,), "uint32", data=w1.data)
            wv2 = T.decl_buffer((n2 * kw,), "uint32", data=w2.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        shared_x(xv, None, [wv0, wv1, wv2], [y0, y1, y2], bx, ty, tx)

    return gemv.with_attr("global_symbol", gemv_symbol(m, outs if len(outs) > 1 else n0, k, weight_dtype, tuning,
                                                       epilogue, norm_eps))


def _norm_prim_func(m, outs, k, wd, epilogue, grid, warps, rows_of, shared_x):
    """make_gpu_gemv's forms with the RMSNorm prologue: g (the norm's weight, float16[k]) after x."""
    kw, n0 = k // 2, outs[0]
    if epilogue == "swiglu":
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), g: T.Buffer((k,), "float16"), wg: T.Buffer((n0, k), wd),
                 wu: T.Buffer((n0, k), wd), y: T.Buffer((m, n0), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            nv = T.decl_buffer((kw,), "uint32", data=g.data)          # [k] 16-bit -> [k / 2] words
            gv = T.decl_buffer((n0 * kw,), "uint32", data=wg.data)    # [n, k] 16-bit -> [n * k / 2] words
            uv = T.decl_buffer((n0 * kw,), "uint32", data=wu.data)    # [n, k] 16-bit -> [n * k / 2] words
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        rows_of(xv, nv, gv, uv, None, y, n0, bx, ty, tx)
    elif len(outs) == 1:
        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), g: T.Buffer((k,), "float16"), w: T.Buffer((n0, k), wd),
                 y: T.Buffer((m, n0), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            nv = T.decl_buffer((kw,), "uint32", data=g.data)          # [k] 16-bit -> [k / 2] words
            wv = T.decl_buffer((n0 * kw,), "uint32", data=w.data)     # [n, k] 16-bit -> [n * k / 2] words
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        rows_of(xv, nv, wv, None, None, y, n0, bx, ty, tx)
    elif len(outs) == 2:
        n1 = outs[1]

        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), g: T.Buffer((k,), "float16"), w0: T.Buffer((n0, k), wd),
                 w1: T.Buffer((n1, k), wd), y0: T.Buffer((m, n0), "float16"), y1: T.Buffer((m, n1), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            nv = T.decl_buffer((kw,), "uint32", data=g.data)          # [k] 16-bit -> [k / 2] words
            wv0 = T.decl_buffer((n0 * kw,), "uint32", data=w0.data)   # [n_i, k] 16-bit -> [n_i * k / 2] words
            wv1 = T.decl_buffer((n1 * kw,), "uint32", data=w1.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        shared_x(xv, nv, [wv0, wv1], [y0, y1], bx, ty, tx)
    else:
        n1, n2 = outs[1], outs[2]

        @T.prim_func
        def gemv(x: T.Buffer((m, k), "float16"), g: T.Buffer((k,), "float16"), w0: T.Buffer((n0, k), wd),
                 w1: T.Buffer((n1, k), wd), w2: T.Buffer((n2, k), wd), y0: T.Buffer((m, n0), "float16"),
                 y1: T.Buffer((m, n1), "float16"), y2: T.Buffer((m, n2), "float16")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
            nv = T.decl_buffer((kw,), "uint32", data=g.data)          # [k] 16-bit -> [k / 2] words
            wv0 = T.decl_buffer((n0 * kw,), "uint32", data=w0.data)   # [n_i, k] 16-bit -> [n_i * k / 2] words
            wv1 = T.decl_buffer((n1 * kw,), "uint32", data=w1.data)
            wv2 = T.decl_buffer((n2 * kw,), "uint32", data=w2.data)
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        shared_x(xv, nv, [wv0, wv1, wv2], [y0, y1, y2], bx, ty, tx)
    return gemv
