"""The GPU stage's decode GEMVs for m rows (schedules/gpu/gemv.py: fp16 / bf16 weights; quant_gemv.py: the
quantized types) without a GPU: PrimFuncs, an sm_90 cubin through nvcc, and their generated CUDA source run on
CPU threads (test_gpu_quant_kernels' harness: one std::thread per CUDA thread) against float64, with each row
of an m-row call bit-identical to a 1-row call on that row alone (batch invariance, issue 19). The harness
compiles without FMA contraction where nvcc contracts, so bits here are not the GPU's; the GPU check
(tests/device/device_gemv_gpu_check.py) repeats the bitwise comparison there.
Shapes with edges: n = 13 leaves the last row group part-empty, k = 264 a last step past the row end.
"""
import re
import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")

from helmc.errors import HelmcError  # noqa: E402
from helmc.schedules.gpu.gemv import WARP, default_tuning, gemv_symbol, make_gpu_gemv  # noqa: E402
from helmc.schedules.gpu import quant_gemv  # noqa: E402
from test_gpu_quant_kernels import HARNESS, _cuda_source, _device_check, _rel, cgs  # noqa: E402

ROWS = (1, 2, 3, 8)
_ARG = {"x_ptr": "x", "xv_ptr": "x", "wv_ptr": "w", "w_ptr": "w", "y_ptr": "y"}


def _emulate(tmp_path, source: str):
    import ctypes
    import subprocess
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    driver = []
    for name, params in re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', body):
        args = [f"({c}*){_ARG[p]}" for c, p in (re.match(r"\s*(\w+)\*\s*__restrict__\s*(\w+)", q).groups()
                                                for q in params.split(","))]
        driver.append(f'extern "C" void run_{name}(void* x, void* w, void* y, int grid, int bdx, int bdy) {{\n'
                      f"    launch(grid, bdx, bdy, [&] {{ {name}({', '.join(args)}); }});\n}}\n")
    src = tmp_path / "kernels.cpp"
    src.write_text(HARNESS + body + "".join(driver))
    lib = tmp_path / "kernels.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
                    str(src), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _call(lib, sym, x, w, y, grid, warps):
    import ctypes
    vp = ctypes.c_void_p
    getattr(lib, f"run_{sym}_kernel")(vp(x.ctypes.data), vp(w.ctypes.data), vp(y.ctypes.data),
                                      ctypes.c_int(grid), ctypes.c_int(WARP), ctypes.c_int(warps))


def _bf16(a: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) of float32 values, rounded to nearest even."""
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_primfuncs_and_bad_shapes():
    for m in ROWS:
        f = make_gpu_gemv(m, 4096, 4096, "float16")
        assert [(str(p.dtype), tuple(int(s) for s in p.shape)) for p in f.params] == [
            ("float16", (m, 4096)), ("float16", (4096, 4096)), ("float16", (m, 4096))]
        assert f.attrs["global_symbol"] == f"helmc_gpu_gemv_f16_m{m}_n4096_k4096" and bool(f.attrs["tirx.is_scheduled"])
    assert gemv_symbol(1, 8, 64, "bfloat16", (1, 2, 3)) == "helmc_gpu_gemv_bf16_m1_n8_k64_r1w2u3"
    assert quant_gemv.gemv_symbol("q4_k", 8, 256, m=4) == "helmc_gpu_gemv_q4_k_n8_k256_m4"
    for bad in (dict(m=9), dict(k=12), dict(dtype="float32")):
        args = dict(m=1, n=8, k=64, dtype="float16") | bad
        with pytest.raises(HelmcError, match="GPU GEMV"):
            make_gpu_gemv(args["m"], args["n"], args["k"], args["dtype"])
    with pytest.raises(HelmcError, match="m >= 1"):
        quant_gemv.make_gpu_gemv_quant("q8_0", 8, 256, m=0)


@pytest.mark.slow
@pytest.mark.skipif(cgs.find_nvcc() is None, reason="needs nvcc")
def test_build_to_sm90_cubin(tmp_path):
    funcs = {}
    for m in (1, 8):
        for f in (make_gpu_gemv(m, 4096, 4096, "float16"), make_gpu_gemv(m, 4096, 12288, "bfloat16"),
                  quant_gemv.make_gpu_gemv_quant("q4_k", 4096, 4096, m=m)):
            funcs[str(f.attrs["global_symbol"])] = f
    source = _cuda_source(funcs)
    for sym in funcs:
        assert re.search(rf'__global__ void __launch_bounds__\(\d+\) {sym}_kernel\(', source), sym
    assert "uint4" in source                                            # 16-byte loads
    cubin = tmp_path / "gemv.sm_90.cubin"
    cgs.compile_cuda_source(source, "sm_90", str(cubin))
    assert cubin.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float_gemv_on_cpu_threads_rows_bitwise(tmp_path, dtype):
    n, k = 13, 264
    tunings = {m: default_tuning(m) for m in ROWS} | {"tuned": (3, 2, 3)}
    funcs = {m: make_gpu_gemv(m if m != "tuned" else 1, n, k, dtype, t) for m, t in tunings.items()}
    lib = _emulate(tmp_path, _cuda_source({str(f.attrs["global_symbol"]): f for f in funcs.values()}))
    rng = np.random.default_rng(5)
    w32 = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w = w32.astype(np.float16) if dtype == "float16" else _bf16(w32)
    w64 = w.astype(np.float64) if dtype == "float16" else (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    x = rng.standard_normal((max(ROWS), k)).astype(np.float16)
    ref = x.astype(np.float64) @ w64.T
    rows = {}
    for m, f in funcs.items():
        rows_, warps, _ = tunings[m]
        mm = 1 if m == "tuned" else m
        y = np.full((mm, n), np.nan, np.float16)
        _call(lib, str(f.attrs["global_symbol"]), np.ascontiguousarray(x[:mm]), w, y, -(-n // rows_), warps)
        assert _rel(y, ref[:mm]) < 2e-3, (m, _rel(y, ref[:mm]))
        rows[m] = y
    singles = []
    for t in range(max(ROWS)):                       # each row alone through the 1-row kernel
        y = np.full((1, n), np.nan, np.float16)
        _call(lib, str(funcs[1].attrs["global_symbol"]), np.ascontiguousarray(x[t:t + 1]), w, y,
              -(-n // default_tuning(1)[0]), default_tuning(1)[1])
        singles.append(y[0])
    for m in ROWS:
        assert all(np.array_equal(rows[m][t].view(np.uint16), singles[t].view(np.uint16)) for t in range(m)), m
    assert np.array_equal(rows["tuned"][0].view(np.uint16), singles[0].view(np.uint16))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("qtype,k", [("q8_0", 352), ("q4_0", 608), ("q4_k", 1280), ("q6_k", 768)])
def test_quant_gemv_on_cpu_threads_rows_bitwise(tmp_path, qtype, k):
    pytest.importorskip("gguf")
    n = 13
    check = _device_check()
    funcs = {m: quant_gemv.make_gpu_gemv_quant(qtype, n, k, m=m) for m in (1, 3, 8)}
    lib = _emulate(tmp_path, _cuda_source({str(f.attrs["global_symbol"]): f for f in funcs.values()}))
    rng = np.random.default_rng(sum(map(ord, qtype)))
    w = check.random_quant_rows(qtype, n, k, rng)
    ref = rng.standard_normal((8, k)).astype(np.float16)
    want = ref.astype(np.float64) @ check.dequantize_reference(qtype, w).astype(np.float64).T
    grid = -(-n // (quant_gemv.ROWS_PER_WARP * quant_gemv.WARPS))
    out = {}
    for m, f in funcs.items():
        ys = []
        for t0 in range(0, 8, m):
            mm = min(m, 8 - t0)
            if mm < m:
                continue
            y = np.full((m, n), np.nan, np.float16)
            _call(lib, str(f.attrs["global_symbol"]), np.ascontiguousarray(ref[t0:t0 + m]), w, y, grid, quant_gemv.WARPS)
            ys.append(y)
        out[m] = np.concatenate(ys)
        assert _rel(out[m], want[:len(out[m])]) < 2e-3
    for m in (3, 8):
        assert np.array_equal(out[m].view(np.uint16), out[1][:len(out[m])].view(np.uint16)), m
