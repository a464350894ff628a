"""CUDA kernels (scheduled TIR) for the GPU stage's elementwise work around the decode GEMVs, fused by hand.

TVM's FuseOps leaves the exported RMSNorm in three kernels (the fp32 cast, x*x, the rest), the q/k norms and
RoPE in seven (casts of cos/sin, the norm's three, the rotation) and the residual add apart from the norm
after it: ~20 launches per layer of ~3 us each, a third of an all-GPU Qwen3-8B Q4_K decode step (a
per-kernel table). helmc.compiler.passes.fuse_gpu_norms matches those graphs and calls these instead:

  rms_norm(x, w) -> y                    y = fp16(fp32(w) * (fp32(x) * 1/sqrt(mean(fp32(x)^2) + eps)))
  add_rms_norm(a, b, w) -> (s, y)        s = a + b (fp16 add), y = rms_norm(s, w): the residual and its norm
  rms_norm_rope(x, w, cos, sin) -> y     per-head norm (q/k norm) then rotate-half RoPE, x [S, heads, D]

Each is the exported graph's arithmetic in its order and precisions: fp32 for the norm, fp16 for the residual
add and for RoPE's products and sum (the export rounds the normed q/k, cos and sin to fp16 and rotates in
fp16, as HF's fp16 model does). Only the mean's summation order differs from TVM's reduction schedule.

Work split: one thread block per row of D (rows = every axis but the last), VEC consecutive elements per
thread (16-byte loads for VEC = 8), the sum of squares reduced with warp shuffles and, across warps, through
shared memory and summed by every thread in the same order (so every thread holds the same mean). RoPE
needs the element D/2 away, which another thread holds: the normed row goes through shared memory.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from helmc.errors import HelmcError

WARP = 32
_F32, _F16 = "float32", "float16"


def _layout(d: int) -> tuple[int, int, int]:
    """(elements per thread, threads per block, shuffle width) for rows of d elements."""
    vec = next(v for v in (8, 4, 2, 1) if d % v == 0)
    need = d // vec
    if need > 1024:
        raise HelmcError(f"GPU norm kernel: rows of at most {1024 * vec} elements expected, found {d}")
    # A block's threads fill whole warps (shuffles over a partial warp would read lanes that do not exist);
    # below a warp, a power of two and a shuffle of that width.
    threads = -(-need // WARP) * WARP if need > WARP else 1 << max(0, math.ceil(math.log2(need)))
    return vec, threads, min(threads, WARP)


def norm_symbol(kind: str, shape: tuple) -> str:
    """The PrimFunc's global symbol; a symbolic token count (prefill) is spelled n."""
    return f"helmc_gpu_{kind}_{'x'.join(str(s) if isinstance(s, int) else 'n' for s in shape)}"


def _check(shape: tuple):
    """(rows, d): rows an int, or an expression of the symbolic token count shape[0] (a tirx.Var)."""
    fixed = shape[1:]
    if len(shape) < 2 or any(not isinstance(s, int) or s < 1 for s in fixed) or \
            not (isinstance(shape[0], tirx.Var) or (isinstance(shape[0], int) and shape[0] >= 1)):
        raise HelmcError(f"GPU norm kernel: a shape of rank >= 2, static but for the first axis, expected, found {shape}")
    d = shape[-1]
    return shape[0] * (math.prod(fixed) // d), d


def _row_mean_square(vec: int, threads: int, width: int, d: int):
    """Macro: inv[0] = 1 / sqrt(mean(xf^2) + eps) over the block's row; xf holds this thread's VEC values."""
    warps = threads // width

    mask = 0xFFFFFFFF if width == WARP else (1 << width) - 1       # only lanes that exist

    @T.macro
    def reduce(xf, part, red, inv, tx, eps):
        part[0] = T.float32(0)
        if tx * vec < d:
            for v in T.unroll(vec):
                part[0] = part[0] + xf[v] * xf[v]
        for s in T.unroll(int(math.log2(width))):          # butterfly: every lane ends with its warp's sum
            part[0] = part[0] + T.tvm_warp_shuffle_xor(T.uint32(mask), part[0], (width // 2) >> s,
                                                        width, width)
        if warps > 1:
            if tx % width == 0:
                red[tx // width] = part[0]
            T.tvm_storage_sync("shared")
            part[0] = T.float32(0)
            for i in T.serial(warps):                      # the same order in every thread: the same mean
                part[0] = part[0] + red[i]
        inv[0] = T.float32(1) / T.sqrt(part[0] / T.float32(d) + T.float32(eps))

    return reduce


def make_rms_norm(shape: tuple[int, ...], eps: float, add: bool = False) -> tirx.PrimFunc:
    """PrimFunc(x f16[shape], w f16[D], y f16[shape]), or with add=True PrimFunc(a, b, w, s, y): s = a + b,
    y = rms_norm(s)."""
    rows, d = _check(shape)
    vec, threads, width = _layout(d)
    warps = threads // width
    reduce = _row_mean_square(vec, threads, width, d)

    @T.macro
    def normalize(wv, yv, bx, tx, xh, xf, part, red, inv):
        if tx * vec < d:
            for v in T.unroll(vec):
                xf[v] = T.Cast(_F32, xh[v])
        reduce(xf, part, red, inv, tx, eps)
        if tx * vec < d:
            for v in T.unroll(vec):
                xh[v] = T.Cast(_F16, T.Cast(_F32, wv[tx * vec + v]) * (xf[v] * inv[0]))
            for v in T.vectorized(vec):
                yv[bx * d + tx * vec + v] = xh[v]

    if not add:
        @T.prim_func
        def rms_norm(x: T.Buffer(shape, _F16), w: T.Buffer((d,), _F16), y: T.Buffer(shape, _F16)):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((rows * d,), _F16, data=x.data)          # [rows, d] flat
            yv = T.decl_buffer((rows * d,), _F16, data=y.data)
            for bx in T.thread_binding(rows, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    xh = T.alloc_buffer((vec,), _F16, scope="local")
                    xf = T.alloc_buffer((vec,), _F32, scope="local")
                    part = T.alloc_buffer((1,), _F32, scope="local")
                    inv = T.alloc_buffer((1,), _F32, scope="local")
                    red = T.alloc_buffer((warps,), _F32, scope="shared")
                    if tx * vec < d:
                        for v in T.vectorized(vec):
                            xh[v] = xv[bx * d + tx * vec + v]
                    normalize(w, yv, bx, tx, xh, xf, part, red, inv)

        return rms_norm.with_attr("global_symbol", norm_symbol("rms_norm", shape)).with_attr("helmc_eps", float(eps))

    @T.prim_func
    def add_rms_norm(a: T.Buffer(shape, _F16), b: T.Buffer(shape, _F16), w: T.Buffer((d,), _F16),
                     s: T.Buffer(shape, _F16), y: T.Buffer(shape, _F16)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        av = T.decl_buffer((rows * d,), _F16, data=a.data)              # [rows, d] flat
        bv = T.decl_buffer((rows * d,), _F16, data=b.data)
        sv = T.decl_buffer((rows * d,), _F16, data=s.data)
        yv = T.decl_buffer((rows * d,), _F16, data=y.data)
        for bx in T.thread_binding(rows, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                ah = T.alloc_buffer((vec,), _F16, scope="local")
                xh = T.alloc_buffer((vec,), _F16, scope="local")
                xf = T.alloc_buffer((vec,), _F32, scope="local")
                part = T.alloc_buffer((1,), _F32, scope="local")
                inv = T.alloc_buffer((1,), _F32, scope="local")
                red = T.alloc_buffer((warps,), _F32, scope="shared")
                if tx * vec < d:
                    for v in T.vectorized(vec):
                        ah[v] = av[bx * d + tx * vec + v]
                    for v in T.vectorized(vec):
                        xh[v] = bv[bx * d + tx * vec + v]
                    for v in T.unroll(vec):
                        xh[v] = ah[v] + xh[v]                           # the residual, in fp16 as exported
                    for v in T.vectorized(vec):
                        sv[bx * d + tx * vec + v] = xh[v]
                normalize(w, yv, bx, tx, xh, xf, part, red, inv)

    # helmc_eps: fuse_norm_gemv folds a decode norm into the GEMVs that read it and needs its eps
    return add_rms_norm.with_attr("global_symbol", norm_symbol("add_rms_norm", shape)).with_attr(
        "helmc_eps", float(eps))


def make_rms_norm_rope(shape: tuple[int, ...], eps: float, shape_k: tuple | None = None) -> tirx.PrimFunc:
    """PrimFunc(x f16[S, heads, D], w f16[D], cos f32[S, D], sin f32[S, D], y f16[S, heads, D]):
    y = rope(rms_norm(x) per head), rotate-half RoPE at each token's cos/sin.
    shape_k [S, heads_k, D]: q and k in one launch (a graph node per launch),
    PrimFunc(xq, wq, xk, wk, cos, sin, yq, yk); the blocks of k's rows follow q's, each row computed as alone."""
    shapes = (shape,) if shape_k is None else (shape, shape_k)
    for sh in shapes:
        if len(sh) != 3:
            raise HelmcError(f"GPU norm+RoPE kernel: x of shape [tokens, heads, head_dim] expected, found {sh}")
    rows, d = _check(shape)
    if d % 2:
        raise HelmcError(f"GPU norm+RoPE kernel: an even head_dim expected, found {d}")
    if shape_k is not None and (_check(shape_k)[1] != d or not _same_extent(shape_k[0], shape[0])):
        raise HelmcError(f"GPU norm+RoPE kernel: q and k of one token count and head_dim expected, found {shape}, "
                         f"{shape_k}")
    seq, heads, half = shape[0], shape[1], d // 2
    vec, threads, width = _layout(d)
    warps = threads // width
    reduce = _row_mean_square(vec, threads, width, d)

    @T.macro
    def norm_rope_row(xv, w, cos, sin, yv, bx, heads, tx):
        """Row bx (token bx // heads) of xv [rows, d] into yv."""
        xh = T.alloc_buffer((vec,), _F16, scope="local")
        xf = T.alloc_buffer((vec,), _F32, scope="local")
        part = T.alloc_buffer((1,), _F32, scope="local")
        inv = T.alloc_buffer((1,), _F32, scope="local")
        red = T.alloc_buffer((warps,), _F32, scope="shared")
        row = T.alloc_buffer((d,), _F16, scope="shared")       # the normed row, for the rotation
        if tx * vec < d:
            for v in T.vectorized(vec):
                xh[v] = xv[bx * d + tx * vec + v]
            for v in T.unroll(vec):
                xf[v] = T.Cast(_F32, xh[v])
        reduce(xf, part, red, inv, tx, eps)
        if tx * vec < d:
            for v in T.unroll(vec):
                row[tx * vec + v] = T.Cast(_F16, T.Cast(_F32, w[tx * vec + v]) * (xf[v] * inv[0]))
        T.tvm_storage_sync("shared")
        if tx * vec < d:
            for v in T.unroll(vec):
                # q*cos + rotate_half(q)*sin, each product and the sum rounded to fp16 as exported
                xh[v] = row[tx * vec + v] * T.Cast(_F16, cos[bx // heads, tx * vec + v]) + T.if_then_else(
                    tx * vec + v < half, -row[tx * vec + v + half], row[(tx * vec + v + half) % d]
                ) * T.Cast(_F16, sin[bx // heads, tx * vec + v])
            for v in T.vectorized(vec):
                yv[bx * d + tx * vec + v] = xh[v]

    if shape_k is None:
        @T.prim_func
        def rms_norm_rope(x: T.Buffer(shape, _F16), w: T.Buffer((d,), _F16), cos: T.Buffer((seq, d), _F32),
                          sin: T.Buffer((seq, d), _F32), y: T.Buffer(shape, _F16)):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            xv = T.decl_buffer((rows * d,), _F16, data=x.data)          # [rows, d] flat, row = token * heads + head
            yv = T.decl_buffer((rows * d,), _F16, data=y.data)
            for bx in T.thread_binding(rows, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    norm_rope_row(xv, w, cos, sin, yv, bx, heads, tx)

        return rms_norm_rope.with_attr("global_symbol", norm_symbol("rms_norm_rope", shape))

    rows_k, heads_k = _check(shape_k)[0], shape_k[1]

    @T.prim_func
    def rms_norm_rope_qk(xq: T.Buffer(shape, _F16), wq: T.Buffer((d,), _F16), xk: T.Buffer(shape_k, _F16),
                         wk: T.Buffer((d,), _F16), cos: T.Buffer((seq, d), _F32), sin: T.Buffer((seq, d), _F32),
                         yq: T.Buffer(shape, _F16), yk: T.Buffer(shape_k, _F16)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        qv = T.decl_buffer((rows * d,), _F16, data=xq.data)             # [rows, d] flat, row = token * heads + head
        kv = T.decl_buffer((rows_k * d,), _F16, data=xk.data)
        yqv = T.decl_buffer((rows * d,), _F16, data=yq.data)
        ykv = T.decl_buffer((rows_k * d,), _F16, data=yk.data)
        for bx in T.thread_binding(rows + rows_k, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                if bx < rows:                                           # block-uniform: q's rows, then k's
                    norm_rope_row(qv, wq, cos, sin, yqv, bx, heads, tx)
                else:
                    norm_rope_row(kv, wk, cos, sin, ykv, bx - rows, heads_k, tx)

    return rms_norm_rope_qk.with_attr("global_symbol", norm_symbol("rms_norm_rope_qk", shape) + "_" + norm_symbol(
        "", shape_k).removeprefix("helmc_gpu__"))


def _same_extent(a, b) -> bool:
    """One token count: the same int, or the same symbolic variable."""
    return a == b if isinstance(a, int) or isinstance(b, int) else a.same_as(b)
