"""The int8-activation decode GEMV for q3_k / q4_k / q5_k / q6_k (schedules/gpu/quant_gemv_int8.py) without a GPU.

The generated CUDA source is compiled with g++ against a harness (a std::thread per CUDA thread, warp shuffles and
__syncthreads as barriers, __shared__ arrays as statics of the one block running, __dp4a on signed bytes) and run
on small shapes with edges (a row group past n, a short last step, q6_k blocks at 2 mod 4, x in several chunks).
References, in float64 on gguf's own dequantization of the same rows (tests/quant_rows.py):
- x quantized as the kernel does (per 32 values, dx = amax/127, round half to even): within 2e-3 of max |y|
  (fp32 sums and y's fp16 rounding only; a rounding tie may land the other way on the GPU, where x * inv + C is
  one FMA);
- the fp16 x itself: within 2e-2 (the int8 activations' own error, as in llama.cpp's CUDA decode).
Row t of a batched call equals the 1-row call on x[t] bit for bit, also when x goes through shared memory in
chunks. q5_k / q3_k also bit for bit against an integer reference: the blocks' quants and scales unpacked in numpy
(checked against gguf's dequantization), each lane's integer dots and fp32 sums in the kernel's order.
To rerun: pytest -s tests/kernels/test_gpu_int8_gemv_kernels.py (prints each max difference).
"""
import ctypes
import re
import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from helmc.errors import HelmcError  # noqa: E402
from tests import quant_rows  # noqa: E402
from helmc.schedules.gpu.quant_gemv import gpu_quant_row_bytes  # noqa: E402
from helmc.schedules.gpu.quant_gemv_int8 import (  # noqa: E402
    ROWS_PER_WARP, WARPS, gemv_int8_symbol, make_gpu_gemv_int8, x_chunk)
from helmc.compiler.passes import compile_gpu_stage as cgs  # noqa: E402
from test_gpu_quant_kernels import build_harnessed  # noqa: E402

TUNED = (3, 2, 1)      # rows_per_warp, warps, unroll away from the defaults
SPLIT = (2, 4, 1, True)   # the CTA's 4 warps split each of its 2 rows' blocks (k_split)

_ARG = {"x_ptr": "x", "wv_ptr": "w", "y_ptr": "y"}


def _source(funcs: dict) -> str:
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                                "max_threads_per_block": 1024, "thread_warp_size": 32}, host={"kind": "llvm"})
    sources = cgs._collect_cuda_sources(tvm.compile(tvm.IRModule(funcs), target=target).mod)
    assert len(sources) == 1
    return sources[0]


def _emulate(tmp_path, source: str):
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    drivers = []
    for name, params in re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', body):
        args = []
        for p in params.split(","):
            ctype, pname = re.match(r"\s*(\w+)\*\s*__restrict__\s*(\w+)", p).groups()
            args.append(f"({ctype}*){_ARG[pname]}")
        drivers.append(f'extern "C" void run_{name}(void* x, void* w, void* y, int grid, int bdx, int bdy) {{\n'
                       f"    launch(grid, bdx, bdy, [&] {{ {name}({', '.join(args)}); }});\n}}\n")
    return build_harnessed(tmp_path / "kernels.cpp", body + "".join(drivers), tmp_path / "kernels.so")


def _call(lib, sym, x, w, y, n, rows, warps, k_split=False):
    vp = ctypes.c_void_p
    getattr(lib, f"run_{sym}_kernel")(vp(x.ctypes.data), vp(w.ctypes.data), vp(y.ctypes.data),
                                      ctypes.c_int(-(-n // (rows * (1 if k_split else warps)))), ctypes.c_int(32),
                                      ctypes.c_int(warps))


def quantize_x(x: np.ndarray) -> np.ndarray:
    """x [m, k] fp16 -> the int8 activations times their scales, as the kernel forms them (float64)."""
    xf = x.astype(np.float32).reshape(x.shape[0], -1, 32)                          # [m, k/32, 32]
    amax = np.abs(xf).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint((xf * inv).astype(np.float32))                                      # half to even, as the 1.5*2^23 add
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def _rel(got, ref):
    assert np.isfinite(got).all()
    return float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def test_symbols_chunks_and_bad_input():
    assert gemv_int8_symbol("q4_k", 8, 256) == "helmc_gpu_gemv8_q4_k_n8_k256"
    assert gemv_int8_symbol("q6_k", 8, 256, m=4, rows_per_warp=3) == "helmc_gpu_gemv8_q6_k_n8_k256_m4_r3w4u2"
    assert gemv_int8_symbol("q4_k", 8, 256, *SPLIT) == "helmc_gpu_gemv8_q4_k_n8_k256_r2w4u1s"
    assert x_chunk(8, 12288, spans=4) == 4096 and x_chunk(8, 12288, spans=2) == 4096
    with pytest.raises(HelmcError, match="8192"):
        x_chunk(8, 12288, spans=8)                  # a k_split chunk of whole 8-warp steps does not fit
    assert x_chunk(1, 12288) == 12288 and x_chunk(8, 12288) == 4096 and x_chunk(8, 4096) == 4096
    with pytest.raises(HelmcError, match="q4_k"):
        make_gpu_gemv_int8("q8_0", 8, 256)
    with pytest.raises(HelmcError):
        make_gpu_gemv_int8("q4_k", 8, 300)
    with pytest.raises(HelmcError):
        x_chunk(64, 4096)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype,n,k", [("q4_k", 13, 1280), ("q6_k", 13, 768), ("q4_k", 16, 2048), ("q6_k", 16, 2048),
                                        ("q5_k", 13, 1280), ("q3_k", 13, 768)])
def test_generated_cuda_on_cpu_threads(tmp_path, qtype, n, k):
    pytest.importorskip("gguf")
    check = quant_rows
    sym, tuned, split = (gemv_int8_symbol(qtype, n, k), gemv_int8_symbol(qtype, n, k, *TUNED),
                         gemv_int8_symbol(qtype, n, k, *SPLIT))
    lib = _emulate(tmp_path, _source({sym: make_gpu_gemv_int8(qtype, n, k), tuned: make_gpu_gemv_int8(qtype, n, k, *TUNED),
                                      split: make_gpu_gemv_int8(qtype, n, k, *SPLIT)}))
    rng = np.random.default_rng(7 + sum(map(ord, qtype)))
    w = check.random_quant_rows(qtype, n, k, rng)                                   # [n, row_bytes] uint8
    assert w.shape == (n, gpu_quant_row_bytes(qtype, k))
    dense = check.dequantize_reference(qtype, w).astype(np.float64)                 # [n, k]
    x = rng.standard_normal((1, k)).astype(np.float16)
    x[0, :32] = 0                                                                   # a block of zeros: amax 0
    ref_q, ref_16 = (quantize_x(x) @ dense.T)[0], (x.astype(np.float64) @ dense.T)[0]
    for s, (rows, warps, *_rest) in ((sym, (ROWS_PER_WARP, WARPS, 0)), (tuned, TUNED), (split, SPLIT)):
        y = np.full((1, n), np.nan, np.float16)
        _call(lib, s, x, w, y, n, rows, warps, k_split=s == split)
        err_q, err_16 = _rel(y[0], ref_q), _rel(y[0], ref_16)
        print(f"\n{s}: max difference {err_q:.2e} of max |y| (int8 x reference), {err_16:.2e} (fp16 x)")
        assert err_q < 2e-3 and err_16 < 2e-2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q5_k"])
def test_rows_are_batch_invariant_through_chunks(tmp_path, qtype):
    """m = 8 at k = 5120 puts x through shared memory in two chunks (4096 + 1024); m = 1 and 3 in one."""
    pytest.importorskip("gguf")
    n, k = 13, 5120
    assert x_chunk(8, k) < k == x_chunk(1, k) == x_chunk(3, k)
    check = quant_rows
    funcs = {m: make_gpu_gemv_int8(qtype, n, k, m=m) for m in (1, 3, 8)}
    lib = _emulate(tmp_path, _source({gemv_int8_symbol(qtype, n, k, m=m): f for m, f in funcs.items()}))
    rng = np.random.default_rng(11)
    w = check.random_quant_rows(qtype, n, k, rng)
    x = rng.standard_normal((8, k)).astype(np.float16)
    ys = {}
    for m in (1, 3, 8):
        rows = x[:m] if m > 1 else x[:1]
        ys[m] = np.full((m, n), np.nan, np.float16)
        _call(lib, gemv_int8_symbol(qtype, n, k, m=m), np.ascontiguousarray(rows), w, ys[m], n, ROWS_PER_WARP, WARPS)
    singles = []
    for t in range(8):
        y1 = np.full((1, n), np.nan, np.float16)
        _call(lib, gemv_int8_symbol(qtype, n, k), np.ascontiguousarray(x[t:t + 1]), w, y1, n, ROWS_PER_WARP, WARPS)
        singles.append(y1[0])
    assert np.array_equal(ys[1][0], singles[0])
    assert np.array_equal(ys[3], np.stack(singles[:3]))
    assert np.array_equal(ys[8], np.stack(singles))                                # chunked == whole, bit for bit
    dense = check.dequantize_reference(qtype, w).astype(np.float64)
    print(f"\n{qtype} m=8 in chunks: max difference {_rel(ys[8], quantize_x(x) @ dense.T):.2e} of max |y|")
    assert _rel(ys[8], quantize_x(x) @ dense.T) < 2e-3


def _call_multi(lib, sym, x, pointers, grid, warps):
    """run_<kernel>(x, 6 more pointers: the weights then the outputs, padded, grid, 32, warps)."""
    assert len(pointers) == 6
    vp = ctypes.c_void_p
    getattr(lib, f"run_{sym}_kernel")(vp(x.ctypes.data), *[vp(a.ctypes.data) for a in pointers], ctypes.c_int(grid),
                                      ctypes.c_int(32), ctypes.c_int(warps))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype,outs,m,tuning", [("q4_k", (24, 8, 8), 1, ()), ("q6_k", (16, 13), 3, ()),
                                                  ("q4_k", (24, 8, 8), 2, SPLIT), ("q5_k", (24, 8, 8), 2, SPLIT),
                                                  ("q3_k", (16, 13), 1, ())])
def test_one_launch_over_several_weights_equals_separate_launches(tmp_path, qtype, outs, m, tuning):
    """q, k, v (or gate, up) of one x in one kernel: each y bit-identical to its own kernel's (k_split too)."""
    pytest.importorskip("gguf")
    k = 1280 if qtype in ("q4_k", "q5_k") else 768
    check = quant_rows
    fused = make_gpu_gemv_int8(qtype, outs, k, *tuning, m=m)
    singles = {n: make_gpu_gemv_int8(qtype, n, k, *tuning, m=m) for n in set(outs)}
    rows, warps = tuning[:2] if tuning else (ROWS_PER_WARP, WARPS)
    cta_rows = rows if tuning[3:] else rows * warps
    source = _source({str(f.attrs["global_symbol"]): f for f in [fused, *singles.values()]})
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    drivers = []
    for name, params in re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', body):
        names = [re.match(r"\s*(\w+)\*\s*__restrict__\s*(\w+)", p).groups() for p in params.split(",")]
        order = {"x_ptr": 0} | {f"wv{i}_ptr": 1 + i for i in range(3)} | {"wv_ptr": 1} | \
            {f"y{i}_ptr": 1 + len(outs) + i for i in range(3)} | {"y_ptr": 2}
        args = ", ".join(f"({c}*)a[{order[p]}]" for c, p in names)
        drivers.append(f'extern "C" void run_{name}(void* a0, void* a1, void* a2, void* a3, void* a4, void* a5, '
                       f'void* a6, int grid, int bdx, int bdy) {{\n    void* a[7] = {{a0, a1, a2, a3, a4, a5, a6}};\n'
                       f"    launch(grid, bdx, bdy, [&] {{ {name}({args}); }});\n}}\n")
    lib = build_harnessed(tmp_path / "kernels.cpp", body + "".join(drivers), tmp_path / "k.so")
    rng = np.random.default_rng(3)
    ws = [check.random_quant_rows(qtype, n, k, rng) for n in outs]
    x = rng.standard_normal((m, k)).astype(np.float16)
    null = np.zeros(1, np.uint8)
    ys = [np.full((m, n), np.nan, np.float16) for n in outs]
    grid = sum(-(-n // cta_rows) for n in outs)
    args = ws + ys + [null] * (6 - 2 * len(outs))
    _call_multi(lib, gemv_int8_symbol(qtype, outs, k, *tuning, m=m), x, args[:6], grid, warps)
    for w, y, n in zip(ws, ys, outs):
        alone = np.full((m, n), np.nan, np.float16)
        _call_multi(lib, gemv_int8_symbol(qtype, n, k, *tuning, m=m), x, [w, alone, null, null, null, null],
                    -(-n // cta_rows), warps)
        assert np.isfinite(y).all() and np.isfinite(alone).all()
        assert np.array_equal(y.view(np.uint16), alone.view(np.uint16)), (n, y, alone)
    print(f"\n{gemv_int8_symbol(qtype, outs, k, *tuning, m=m)}: every output bit-identical to its own launch")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_split_k_rows_are_batch_invariant_through_chunks(tmp_path):
    """k_split (4 warps share a CTA's rows, each taking every 4th step of their blocks, sums added in warp order):
    m = 8 at k = 8192 goes through shared memory in two chunks of whole 4-warp steps (4096 each); every row equals
    the 1-row call bit for bit, and the result is the int8 reference's."""
    pytest.importorskip("gguf")
    qtype, n, k, (rows, warps, unroll, _) = "q4_k", 5, 8192, SPLIT
    assert x_chunk(8, k, spans=warps) == 4096 < k == x_chunk(1, k, spans=warps)
    check = quant_rows
    lib = _emulate(tmp_path, _source({gemv_int8_symbol(qtype, n, k, *SPLIT, m=m): make_gpu_gemv_int8(
        qtype, n, k, *SPLIT, m=m) for m in (1, 8)}))
    rng = np.random.default_rng(13)
    w = check.random_quant_rows(qtype, n, k, rng)
    x = rng.standard_normal((8, k)).astype(np.float16)
    y8 = np.full((8, n), np.nan, np.float16)
    _call(lib, gemv_int8_symbol(qtype, n, k, *SPLIT, m=8), x, w, y8, n, rows, warps, k_split=True)
    singles = []
    for t in range(8):
        y1 = np.full((1, n), np.nan, np.float16)
        _call(lib, gemv_int8_symbol(qtype, n, k, *SPLIT), np.ascontiguousarray(x[t:t + 1]), w, y1, n, rows, warps,
              k_split=True)
        singles.append(y1[0])
    assert np.array_equal(y8, np.stack(singles))
    dense = check.dequantize_reference(qtype, w).astype(np.float64)
    print(f"\nk_split m=8 in chunks: max difference {_rel(y8, quantize_x(x) @ dense.T):.2e} of max |y|")
    assert _rel(y8, quantize_x(x) @ dense.T) < 2e-3


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype,m,tuning", [("q4_k", 1, ()), ("q6_k", 3, ()), ("q4_k", 2, (1, 8, 2)),
                                            ("q5_k", 2, (1, 8, 2)), ("q3_k", 1, ())])
def test_epilogues_equal_gemv_then_the_stages_elementwise_kernels(tmp_path, qtype, m, tuning):
    """swiglu: silu(x @ wg^T) * (x @ wu^T) in one launch is the gate and up int8 GEMVs, then the stage's own
    sigmoid-multiply kernel, bit for bit; residual: the down GEMV then the add kernel. Half arithmetic rounds to
    fp16 in the harness as on the GPU (test_gpu_gemv_kernels.HALF_OPS)."""
    pytest.importorskip("gguf")
    from test_gpu_gemv_kernels import HALF_OPS, _elementwise_source, _emulate_named, _run_named
    n, k = 21, 768
    rows, warps = tuning[:2] if tuning else (ROWS_PER_WARP, WARPS)
    funcs = [make_gpu_gemv_int8(qtype, n, k, *tuning, m=m, epilogue=e) for e in (None, "swiglu", "residual")]
    source = _source({str(f.attrs["global_symbol"]): f for f in funcs})
    elementwise = _elementwise_source(m, n)
    assert HALF_OPS and "blockIdx" not in elementwise                 # one block of threads covers [m, n]
    emulated = _emulate_named(tmp_path, source + elementwise[elementwise.index('extern "C" __global__'):])
    check = quant_rows
    rng = np.random.default_rng(29 + m)
    wg, wu = (check.random_quant_rows(qtype, n, k, rng) for _ in range(2))
    x = rng.standard_normal((m, k)).astype(np.float16)
    r = rng.standard_normal((m, n)).astype(np.float16)
    grid, bdx = -(-n // (rows * warps)), -(-m * n // 32) * 32
    sym = lambda e=None: f"{gemv_int8_symbol(qtype, n, k, *tuning, m=m, epilogue=e)}_kernel"   # noqa: E731
    g, u = (np.full((m, n), np.nan, np.float16) for _ in range(2))
    _run_named(emulated, sym(), {"x": x, "wv": wg, "y": g}, grid, 32, warps)
    _run_named(emulated, sym(), {"x": x, "wv": wu, "y": u}, grid, 32, warps)
    want = np.full((m, n), np.nan, np.float16)
    _run_named(emulated, "fused_tir_sigmoid_multiply_multiply_kernel", {"g": g, "u": u, "out": want}, 1, bdx, 1)
    got = np.full((m, n), np.nan, np.float16)
    _run_named(emulated, sym("swiglu"), {"x": x, "gv": wg, "uv": wu, "y": got}, grid, 32, warps)
    assert np.isfinite(got).all() and np.array_equal(got.view(np.uint16), want.view(np.uint16)), (got, want)
    assert len(np.unique(got)) > m * n // 2                             # outputs spread: not one value
    dense = check.dequantize_reference(qtype, wg).astype(np.float64)
    print(f"\n{sym('swiglu')}: bit-identical to gate, up, then the elementwise kernel; gate's max difference "
          f"{_rel(g, quantize_x(x) @ dense.T):.2e} of max |y|")
    assert _rel(g, quantize_x(x) @ dense.T) < 2e-3
    want = np.full((m, n), np.nan, np.float16)
    _run_named(emulated, "add_kernel", {"r": r, "y": g, "out": want}, 1, bdx, 1)
    got = np.full((m, n), np.nan, np.float16)
    _run_named(emulated, sym("residual"), {"x": x, "wv": wg, "r": r, "y": got}, grid, 32, warps)
    assert np.isfinite(got).all() and np.array_equal(got.view(np.uint16), want.view(np.uint16)), (got, want)
    with pytest.raises(HelmcError, match="epilogue"):
        make_gpu_gemv_int8(qtype, (n, n), k, epilogue="swiglu")
    with pytest.raises(HelmcError, match="epilogue"):
        make_gpu_gemv_int8(qtype, n, k, *SPLIT, epilogue="residual")


def _unpack_q5_k(w: np.ndarray, k: int):
    """Quants [n, k] (0..31), per-32 scale and min [n, k/32] (0..63), d and dmin [n, k/256] (fp32) of q5_k rows, as
    ggml's dequantize_row_q5_K reads the block (w = d*sc*q - dmin*m)."""
    b = w.reshape(w.shape[0], k // 256, 176).astype(np.int64)
    d, dmin = (w.reshape(w.shape[0], k // 256, 176)[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32)
               for o in (0, 2))
    s = b[..., 4:16]
    lo = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)    # [n, blocks, 8]
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qh, qs = b[..., 16:48], b[..., 48:176]
    q = np.empty(b.shape[:2] + (8, 32), np.int64)                                   # [n, blocks, sub-block, l]
    for j in range(8):
        q[..., j, :] = ((qs[..., 32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2))) & 0xF) | (((qh >> j) & 1) << 4)
    return q.reshape(w.shape[0], k), lo.reshape(w.shape[0], -1), mn.reshape(w.shape[0], -1), d, dmin


def _unpack_q3_k(w: np.ndarray, k: int):
    """Quants [n, k] (0..7), per-16 scales [n, k/16] (0..63) and d [n, k/256] of q3_k rows (w = d*(sc-32)*(q-4))."""
    b = w.reshape(w.shape[0], k // 256, 110).astype(np.int64)
    d = w.reshape(w.shape[0], k // 256, 110)[..., 108:110].copy().view(np.float16)[..., 0].astype(np.float32)
    hm, qs, s = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    sc = np.stack([((s[..., j] if j < 8 else s[..., j - 8] >> 4) & 0xF)
                   | (((s[..., 8 + j % 4] >> (2 * (j // 4))) & 3) << 4) for j in range(16)], -1)
    q = np.empty(b.shape[:2] + (2, 4, 32), np.int64)                                # [n, blocks, h, c, l]
    for h in range(2):
        for c in range(4):
            q[..., h, c, :] = ((qs[..., 32 * h:32 * h + 32] >> (2 * c)) & 3) | (((hm >> (4 * h + c)) & 1) << 2)
    return q.reshape(w.shape[0], k), sc.reshape(w.shape[0], -1), d


def _integer_reference(qtype: str, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y [1, n] fp16 as the default kernel (2 rows per warp, 4 warps, no k_split) forms it at m = 1: lane tx takes
    blocks tx//8, + 4, ... and lane t = tx % 8's runs in order, acc += its fp32 term of the integer dots; the 32
    lanes are summed by the xor butterfly."""
    n, k = w.shape[0], x.shape[1]
    f32 = np.float32
    xf = x.astype(f32).reshape(-1, 32)
    amax = np.abs(xf).max(-1)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, 1), f32(0)).astype(f32)
    xq = np.rint((xf * inv[:, None]).astype(f32)).astype(np.int64).reshape(-1)
    dx = (amax / f32(127)).astype(f32)
    if qtype == "q5_k":
        q, sc, mn, d, dmin = _unpack_q5_k(w, k)
        runs = [(64 * (t // 2) + 32 * g + 16 * (t % 2), 16) for t in range(8) for g in range(2)]
        dense = (d.repeat(8, -1).repeat(32, -1) * sc.repeat(32, -1) * q - dmin.repeat(8, -1).repeat(32, -1) *
                 mn.repeat(32, -1))
    else:
        q, sc, d = _unpack_q3_k(w, k)
        runs = [(128 * (t // 4) + 32 * c + 8 * (t % 4), 8) for t in range(8) for c in range(4)]
        dense = d.repeat(16, -1).repeat(16, -1) * (sc.repeat(16, -1) - 32) * (q - 4)
    # the unpacking is the format: the same weights as gguf's dequantizer
    np.testing.assert_allclose(dense, quant_rows.dequantize_reference(qtype, w), rtol=1e-6, atol=1e-7)
    per_lane = len(runs) // 8
    y = np.empty(n, np.float16)
    for row in range(n):
        acc = np.zeros(32, f32)
        for tx in range(32):
            for b in range(tx // 8, k // 256, 4):
                for start, length in runs[(tx % 8) * per_lane:(tx % 8 + 1) * per_lane]:
                    p = b * 256 + start
                    dot, sx = int(q[row, p:p + length] @ xq[p:p + length]), int(xq[p:p + length].sum())
                    if qtype == "q5_k":
                        s1, s2 = f32(d[row, b]) * f32(sc[row, p // 32]), f32(dmin[row, b]) * f32(mn[row, p // 32])
                        term = dx[p // 32] * (s1 * f32(dot) - s2 * f32(sx))
                    else:
                        term = dx[p // 32] * (f32(d[row, b]) * f32(sc[row, p // 16] - 32)) * f32(dot - 4 * sx)
                    acc[tx] = acc[tx] + term
        for s in (16, 8, 4, 2, 1):
            acc = acc + acc[np.arange(32) ^ s]
        y[row] = np.float16(acc[0])
    return y[None]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype,n,k", [("q5_k", 7, 1280), ("q3_k", 7, 768)])
def test_new_types_bit_identical_to_the_integer_reference(tmp_path, qtype, n, k):
    """The q5_k / q3_k kernels' outputs are the integer reference's bits (fp32 evaluated as written: the harness
    compiles without contraction); a wrong fifth / third bit, scale or run would move them."""
    pytest.importorskip("gguf")
    sym = gemv_int8_symbol(qtype, n, k)
    lib = _emulate(tmp_path, _source({sym: make_gpu_gemv_int8(qtype, n, k)}))
    rng = np.random.default_rng(41)
    w = quant_rows.random_quant_rows(qtype, n, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float16)
    x[0, 32:64] = 0
    y = np.full((1, n), np.nan, np.float16)
    _call(lib, sym, x, w, y, n, ROWS_PER_WARP, WARPS)
    want = _integer_reference(qtype, w, x)
    assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (y, want)
    assert len(np.unique(y)) == n
