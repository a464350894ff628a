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

Batch invariance (issue 19): y[t, j] is formed the same way for every m, rows_per_warp, warps and unroll --
lane l of warp w sums x[t, k] * W[j, k] over its k in step order (8 FMAs a step, in k order), the 32 lane sums
meet in the same butterfly, the warps' sums are added in warp order -- so row t of an m-row call is bit-identical to a 1-row call on x[t] alone. The only
choices left to nvcc (FMA contraction of the same expression) are the same for every (t, j).

Loads go through uint32 views (two 16-bit values per word, widened exactly: fp16 by the hardware convert of
its bits, bf16 by a shift), so no 16-bit vector type of TVM's CUDA code generator is involved. k must be a
multiple of 8 and x, W, y 16-byte aligned (TVM and CuPy allocations are; rows are, as k % 8 == 0).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from helmc.errors import HelmcError

WARP = 32
VEC = 8                  # weights per lane per step: one 16-byte load
STEP = WARP * VEC        # weights of a row one warp covers per step
WEIGHT_DTYPES = ("float16", "bfloat16")
MAX_ROWS = 8             # largest m (runtime.stage.decode_batch_sizes stays within it at --max-batch <= 8)
_F32 = "float32"


def default_tuning(m: int) -> tuple[int, int, int]:
    """(rows_per_warp, warps, unroll): one row of x: 2 rows per warp, 4 warps, 4 steps in flight; more rows of
    x: 4 rows per warp (each x load serves 4 rows, see the module docstring) and 2 steps in flight, which keeps
    the m x 4 accumulators and the staged weights in registers. Per-row bits depend on warps only (the k split),
    so warps is the same for every m."""
    return (2, 4, 4) if m == 1 else (4, 4, 2)


def gemv_symbol(m: int, n: int, k: int, weight_dtype: str, tuning: tuple[int, int, int] | None = None) -> str:
    """The PrimFunc's global symbol (a tuning other than default_tuning(m) appended); its kernel is + "_kernel"."""
    short = {"float16": "f16", "bfloat16": "bf16"}[weight_dtype]
    tail = "" if tuning is None or tuning == default_tuning(m) else "_r{}w{}u{}".format(*tuning)
    return f"helmc_gpu_gemv_{short}_m{m}_n{n}_k{k}{tail}"


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


def make_gpu_gemv(m: int, n: int, k: int, weight_dtype: str,
                  tuning: tuple[int, int, int] | None = None) -> tirx.PrimFunc:
    """PrimFunc(x: float16[m, k], w: weight_dtype[n, k], y: float16[m, n]) with y = x @ w^T (fp32 sums).
    tuning: (rows_per_warp, warps, unroll), default default_tuning(m)."""
    tuning = tuning or default_tuning(m)
    _check(m, n, k, weight_dtype, tuning)
    rows, warps, unroll = tuning
    words = VEC // 2                                # uint32 words per lane per step and row
    kw = k // 2                                     # words per row
    steps = -(-k // STEP)
    outer = -(-steps // (warps * unroll))           # warp ty takes steps ty, ty + warps, ...; lanes past k skip
    grid = -(-n // rows)

    @T.prim_func
    def gemv(x: T.Buffer((m, k), "float16"), w: T.Buffer((n, k), weight_dtype), y: T.Buffer((m, n), "float16")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        xv = T.decl_buffer((m * kw,), "uint32", data=x.data)      # [m, k] 16-bit -> [m * k / 2] words
        wv = T.decl_buffer((n * kw,), "uint32", data=w.data)      # [n, k] 16-bit -> [n * k / 2] words
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    red = T.alloc_buffer((m * rows * warps,), _F32, scope="shared")   # [m, rows, warps]
                    acc = T.alloc_buffer((m, rows), _F32, scope="local")
                    wl = T.alloc_buffer((unroll, rows, words), "uint32", scope="local")
                    xl = T.alloc_buffer((words,), "uint32", scope="local")
                    xf = T.alloc_buffer((VEC,), _F32, scope="local")
                    tot = T.alloc_buffer((1,), _F32, scope="local")
                    for t in T.unroll(m):
                        for r in T.unroll(rows):
                            acc[t, r] = T.float32(0)
                    for so in T.serial(outer):
                        # The unroll steps' weights first (in flight together), clamped to the last row and the
                        # row's last 16 bytes for loads; their use below skips what is past n or k.
                        for si in T.unroll(unroll):
                            for r in T.unroll(rows):
                                for v in T.vectorized(words):
                                    wl[si, r, v] = wv[T.min(bx * rows + r, n - 1) * kw + T.min(
                                        (((so * unroll + si) * warps + ty) * STEP + tx * VEC) // 2, kw - words) + v]
                        for si in T.unroll(unroll):
                            if ((so * unroll + si) * warps + ty) * STEP + tx * VEC < k:
                                for t in T.unroll(m):
                                    for v in T.vectorized(words):
                                        xl[v] = xv[t * kw + (((so * unroll + si) * warps + ty) * STEP + tx * VEC) // 2 + v]
                                    for e in T.unroll(VEC):
                                        xf[e] = _widen(xl[e // 2], e % 2, "float16")
                                    for r in T.unroll(rows):
                                        for e in T.unroll(VEC):
                                            acc[t, r] = acc[t, r] + xf[e] * _widen(wl[si, r, e // 2], e % 2,
                                                                                   weight_dtype)
                    for t in T.unroll(m):
                        for r in T.unroll(rows):
                            for s in T.unroll(5):             # butterfly: every lane ends with the warp's sum
                                acc[t, r] = acc[t, r] + T.tvm_warp_shuffle_xor(
                                    T.uint32(0xFFFFFFFF), acc[t, r], 16 >> s, WARP, WARP)
                            if tx == 0:
                                red[(t * rows + r) * warps + ty] = acc[t, r]
                    T.tvm_storage_sync("shared")
                    # the warps' sums of one row of y, added in warp order by one thread per (t, r)
                    if ty == 0 and tx < m * rows and bx * rows + tx % rows < n:
                        tot[0] = red[tx * warps]
                        for v in T.unroll(warps - 1):
                            tot[0] = tot[0] + red[tx * warps + v + 1]
                        y[tx // rows, bx * rows + tx % rows] = T.Cast("float16", tot[0])

    return gemv.with_attr("global_symbol", gemv_symbol(m, n, k, weight_dtype, tuning))
