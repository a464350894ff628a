"""The quantized-weight CUDA kernels (schedules/gpu/quant_gemv.py) without a GPU.

- Their PrimFuncs: symbols, buffer dtypes and shapes, the scheduled attribute; bad k / n / type are HelmcErrors.
- Each type's GEMV and dequantizer build for sm_90 as compile_gpu_stage builds a stage: tvm.compile for CUDA, the
  CUDA source taken out of the module, nvcc to a cubin (skipped without nvcc).
- The same generated CUDA source, compiled with g++ against a small harness (one std::thread per CUDA thread,
  __shfl_xor_sync over a per-warp buffer and barriers, half as _Float16), runs on small shapes chosen to hit
  the edges (a last row group past n, a last step past the row end, q6_k rows starting at 2 mod 4), and is
  compared with gguf's numpy dequantizer in float64. tests/kernels/test_quant_gemv_gpu.py
  repeats this on the GPU at real shapes; benchmarks/bench_quant_gemv_gpu.py times it.
"""
import atexit
import ctypes
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")

from helmc.errors import HelmcError  # noqa: E402
from tests import quant_rows  # noqa: E402
from helmc.schedules.gpu.quant_gemv import (  # noqa: E402
    DEQUANT_THREADS, FORMATS, ROWS_PER_WARP, UNROLL, WARP, WARPS, dequantize_symbol, gemv_symbol,
    gpu_quant_row_bytes, make_gpu_dequantize, make_gpu_gemv_quant)

try:
    from helmc.compiler.passes import compile_gpu_stage as cgs
except ImportError:                     # before the compiler's passes moved into helmc/compiler/passes/
    from helmc.compiler import compile_gpu_stage as cgs

QTYPES = tuple(FORMATS)
TOLERANCE = 2e-3   # fp16 rounding of y / of each weight is <= 4.9e-4 of max |ref|; see the device check
# Small shapes with edges: n = 13 leaves the last row group part-empty; k leaves a last step past the row end
# (q8_0 11 blocks, q4_0 / q5_0 / mxfp4 19, q4_k / iq4_xs 5, q3_k / q6_k 3: odd, so q3_k / q6_k / q8_0 / q4_0 / q5_0 blocks
# start at 2 mod 4; mxfp4's 17-byte blocks at every byte offset mod 4). And shapes without edges, where the bounds checks are simplified away (as at the real shapes): n = 16,
# one whole step.
EMULATED = [("q8_0", 13, 352), ("q4_0", 13, 608), ("q5_0", 13, 608), ("q3_k", 13, 768), ("q4_k", 13, 1280),
            ("q5_k", 13, 1280), ("q6_k", 13, 768), ("iq4_xs", 13, 1280),
            ("q8_0", 16, 512), ("q4_0", 16, 1024), ("q5_0", 16, 1024), ("q3_k", 16, 2048), ("q4_k", 16, 2048),
            ("q5_k", 16, 2048), ("q6_k", 16, 2048), ("iq4_xs", 16, 2048),
            ("mxfp4", 13, 608), ("mxfp4", 16, 1024)]
TUNED = (3, 2, 3)   # rows_per_warp, warps, unroll: all away from the defaults


def _target(arch="sm_90"):
    return tvm.target.Target({"kind": "cuda", "arch": arch, "max_shared_memory_per_block": 49152,
                              "max_threads_per_block": 1024, "thread_warp_size": 32}, host={"kind": "llvm"})


def _cuda_source(funcs: dict) -> str:
    ex = tvm.compile(tvm.IRModule(funcs), target=_target())
    sources = cgs._collect_cuda_sources(ex.mod)
    assert len(sources) == 1
    return sources[0]


# ------------------------------------------------------------------------------------------------------------
# PrimFuncs
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", QTYPES)
def test_primfunc_signatures(qtype):
    n, k = 4096, 4096
    fmt = FORMATS[qtype]
    row_bytes = gpu_quant_row_bytes(qtype, k)
    assert row_bytes == k // fmt.weights * fmt.bytes
    gemv, deq = make_gpu_gemv_quant(qtype, n, k), make_gpu_dequantize(qtype, n, k)
    shapes = lambda f: [(str(p.dtype), tuple(int(s) for s in p.shape)) for p in f.params]   # params are buffers
    assert shapes(gemv) == [("float16", (1, k)), ("uint8", (n, row_bytes)), ("float16", (1, n))]
    assert shapes(deq) == [("uint8", (n, row_bytes)), ("float16", (n, k))]
    for f, sym in ((gemv, gemv_symbol(qtype, n, k)), (deq, dequantize_symbol(qtype, n, k))):
        assert f.attrs["global_symbol"] == sym
        assert bool(f.attrs["tirx.is_scheduled"])
    assert gemv_symbol(qtype, n, k) == f"helmc_gpu_gemv_{qtype}_n{n}_k{k}"
    assert gemv_symbol(qtype, n, k, *TUNED) == f"helmc_gpu_gemv_{qtype}_n{n}_k{k}_r3w2u3"
    assert dequantize_symbol(qtype, n, k) == f"helmc_gpu_dequantize_{qtype}_n{n}_k{k}"


@pytest.mark.parametrize("qtype,k", [("q8_0", 100), ("q4_0", 48), ("q4_k", 4096 + 32), ("q6_k", 128), ("q4_k", 0)])
def test_bad_k_is_a_helmc_error(qtype, k):
    for make in (make_gpu_gemv_quant, make_gpu_dequantize):
        with pytest.raises(HelmcError, match="multiple of its"):
            make(qtype, 64, k)
    with pytest.raises(HelmcError, match="multiple of its"):
        gpu_quant_row_bytes(qtype, k)


def test_bad_type_shape_and_tuning_are_helmc_errors():
    with pytest.raises(HelmcError, match="weight type expected"):
        make_gpu_gemv_quant("q2_k", 64, 256)
    with pytest.raises(HelmcError, match="n expected"):
        make_gpu_dequantize("q8_0", 0, 256)
    with pytest.raises(HelmcError, match="2\\^31"):
        make_gpu_dequantize("q8_0", 1 << 20, 1 << 12)
    with pytest.raises(HelmcError, match="rows_per_warp"):
        make_gpu_gemv_quant("q8_0", 64, 256, warps=33)


# ------------------------------------------------------------------------------------------------------------
# CUDA build: tvm.compile -> CUDA source -> nvcc cubin for sm_90
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(cgs.find_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernels_build_to_sm90_cubin(tmp_path, qtype):
    n, k = 4096, 4096
    funcs = {gemv_symbol(qtype, n, k): make_gpu_gemv_quant(qtype, n, k),
             dequantize_symbol(qtype, n, k): make_gpu_dequantize(qtype, n, k)}
    source = _cuda_source(funcs)
    threads = {gemv_symbol(qtype, n, k): WARP * WARPS, dequantize_symbol(qtype, n, k): DEQUANT_THREADS}
    for sym, count in threads.items():
        assert re.search(rf'extern "C" __global__ void __launch_bounds__\({count}\) {sym}_kernel\(', source), sym
    assert "__shfl_xor_sync" in source
    assert "__syncthreads" not in source              # no shared memory, no block barrier
    cubin = tmp_path / f"{qtype}.sm_90.cubin"
    cgs.compile_cuda_source(source, "sm_90", str(cubin))
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    for sym in threads:
        assert f"{sym}_kernel".encode() in data


# ------------------------------------------------------------------------------------------------------------
# The generated CUDA source on CPU threads
# ------------------------------------------------------------------------------------------------------------
# also the int8 and fp16 GEMV tests' harness (block barriers, __shared__ arrays as statics, __dp4a)
HARNESS = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
using std::min; using std::max;
#define uint unsigned int
#define ushort unsigned short
#define uchar unsigned char
#define __global__
#define __restrict__
#define __launch_bounds__(x)
struct Dim3 { int x = 0, y = 0, z = 0; };
struct uint4 { unsigned int x, y, z, w; };
struct int4 { int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct int2 { int x, y; };
struct half {
    _Float16 v;
    half() = default;
    half(float f) : v((_Float16)f) {}
    operator float() const { return (float)v; }
};
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> 8 * i) * (int)(signed char)(b >> 8 * i);
    return c;
}
thread_local Dim3 threadIdx, blockIdx;
thread_local int linear_tid;
static std::barrier<>* warp_barrier[32];
static std::barrier<>* block_barrier;
static float shfl_buf[32][32];
inline float __shfl_xor_sync(unsigned int, float v, int lane_mask, int) {
    int w = linear_tid >> 5, l = linear_tid & 31;
    warp_barrier[w]->arrive_and_wait();
    shfl_buf[w][l] = v;
    warp_barrier[w]->arrive_and_wait();
    return shfl_buf[w][l ^ lane_mask];
}
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
template <class F> static void launch(int grid, int bdx, int bdy, F body) {
    int threads = bdx * bdy;
    for (int b = 0; b < grid; ++b) {
        std::vector<std::barrier<>*> wbs;
        for (int w = 0; w < (threads + 31) / 32; ++w) wbs.push_back(warp_barrier[w] = new std::barrier<>(32));
        block_barrier = new std::barrier<>(threads);
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
            threadIdx.x = t % bdx; threadIdx.y = t / bdx; blockIdx.x = b; linear_tid = t; body(); });
        for (auto& th : ts) th.join();
        for (auto* p : wbs) delete p;
        delete block_barrier;
    }
}
"""

_ARG = {"x_ptr": "x", "wv_ptr": "w", "y_ptr": "y", "out_ptr": "y"}


def _driver(source: str) -> str:
    """One `run_<kernel>(x, w, y_or_out, grid, bdx, bdy)` per kernel, its pointers passed by parameter name."""
    out = []
    for name, params in re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', source):
        args = []
        for p in params.split(","):
            ctype, pname = re.match(r"\s*(\w+)\*\s*__restrict__\s*(\w+)", p).groups()
            args.append(f"({ctype}*){_ARG[pname]}")
        out.append(f'extern "C" void run_{name}(void* x, void* w, void* y, int grid, int bdx, int bdy) {{\n'
                   f"    launch(grid, bdx, bdy, [&] {{ {name}({', '.join(args)}); }});\n}}\n")
    return "".join(out)


GXX = ["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-pthread", "-Winvalid-pch"]
_PCH_DIR: list = []


def _harness_include() -> str:
    """An #include of HARNESS, precompiled once per process: parsing the standard headers it pulls in is most of a
    small kernel build's g++ time, and the kernel tests build one library per case. A build with other options
    than GXX's would not use the precompiled file (-Winvalid-pch says so) and parse the header itself."""
    if not _PCH_DIR:
        d = tempfile.mkdtemp(prefix="helmc-cuda-harness-")
        atexit.register(shutil.rmtree, d, True)
        header = os.path.join(d, "harness.hpp")
        with open(header, "w") as f:
            f.write(HARNESS)
        subprocess.run(GXX + ["-x", "c++-header", header, "-o", header + ".gch"], check=True)
        _PCH_DIR.append(d)
    return f'#include "{_PCH_DIR[0]}/harness.hpp"\n'


def build_harnessed(src, code: str, lib) -> ctypes.CDLL:
    """g++ (GXX) of HARNESS + code written to src, a shared library at lib, loaded."""
    src.write_text(_harness_include() + code)
    subprocess.run(GXX + ["-shared", str(src), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _emulate(tmp_path, source: str):
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    return build_harnessed(tmp_path / "kernels.cpp", body + _driver(body), tmp_path / "kernels.so")


def _call(lib, sym, x, w, y, grid, bdx, bdy):
    vp = ctypes.c_void_p
    getattr(lib, f"run_{sym}_kernel")(vp(0 if x is None else x.ctypes.data), vp(w.ctypes.data), vp(y.ctypes.data),
                                      ctypes.c_int(grid), ctypes.c_int(bdx), ctypes.c_int(bdy))


def _rel(got, ref):
    assert np.isfinite(got).all()
    return float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype,n,k", EMULATED)
def test_generated_cuda_on_cpu_threads(tmp_path, qtype, n, k):
    pytest.importorskip("gguf")
    check = quant_rows
    fmt = FORMATS[qtype]
    gemv_sym, tuned_sym, deq_sym = gemv_symbol(qtype, n, k), gemv_symbol(qtype, n, k, *TUNED), \
        dequantize_symbol(qtype, n, k)
    source = _cuda_source({gemv_sym: make_gpu_gemv_quant(qtype, n, k),
                           tuned_sym: make_gpu_gemv_quant(qtype, n, k, *TUNED),
                           deq_sym: make_gpu_dequantize(qtype, n, k)})
    lib = _emulate(tmp_path, source)

    rng = np.random.default_rng(sum(map(ord, qtype)))
    w = check.random_quant_rows(qtype, n, k, rng)                       # [n, row_bytes] uint8
    assert w.shape == (n, gpu_quant_row_bytes(qtype, k))
    dense = check.dequantize_reference(qtype, w)                        # [n, k] float32
    x = rng.standard_normal((1, k)).astype(np.float16)
    ref = (x.astype(np.float64) @ dense.astype(np.float64).T).reshape(n)

    for sym, (rows, warps, _) in ((gemv_sym, (ROWS_PER_WARP, WARPS, UNROLL)), (tuned_sym, TUNED)):
        y = np.full((1, n), np.nan, np.float16)
        _call(lib, sym, x, w, y, -(-n // (rows * warps)), WARP, warps)
        err = _rel(y.reshape(n), ref)
        print(f"\n{sym} on CPU threads: max relative error {err:.2e}")
        assert err < TOLERANCE

    out = np.full((n, k), np.nan, np.float16)
    _call(lib, deq_sym, None, w, out, -(-(n * k // fmt.weights * fmt.threads) // DEQUANT_THREADS), DEQUANT_THREADS, 1)
    err = _rel(out, dense.astype(np.float64))
    print(f"{deq_sym} on CPU threads: max relative error {err:.2e}")
    assert err < TOLERANCE
    # Each weight is its fp32 value rounded once to fp16 (q4_k's d*sc*q - dmin*m may round twice: 1 ulp).
    ulp = np.abs(out.astype(np.float64) - dense.astype(np.float16).astype(np.float64))
    assert float(ulp.max()) <= float(np.abs(dense).max()) * 2.0 ** -10
