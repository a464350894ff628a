"""The GPU stage's decode GEMVs for m rows (schedules/gpu/gemv.py: fp16 / bf16 weights; quant_gemv.py: the
quantized types) without a GPU: PrimFuncs, an sm_90 cubin through nvcc, and their generated CUDA source run on
CPU threads (test_gpu_quant_kernels' harness: one std::thread per CUDA thread) against float64, with each row
of an m-row call bit-identical to a 1-row call on that row alone (batch invariance). The harness
compiles without FMA contraction where nvcc contracts, so bits here are not the GPU's; the GPU check
(tests/kernels/test_gemv_gpu.py) repeats the bitwise comparison there.
Shapes with edges: n = 13 leaves the last row group part-empty, k = 264 a last step past the row end.
"""
import re
import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")

from helmc.errors import HelmcError  # noqa: E402
from helmc.schedules.gpu.gemv import (  # noqa: E402
    WARP, WEIGHT_DTYPES, default_tuning, gemv_symbol, make_gpu_gemv, parse_gemv_symbol)
from helmc.schedules.gpu import quant_gemv  # noqa: E402
from test_gpu_quant_kernels import _cuda_source, _rel, build_harnessed, cgs  # noqa: E402
from tests import quant_rows  # noqa: E402

ROWS = (1, 2, 3, 8)
_ARG = {"x_ptr": "x", "xv_ptr": "x", "wv_ptr": "w", "w_ptr": "w", "y_ptr": "y"}


def _emulate(tmp_path, source: str):
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    driver = []
    for name, params in re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', body):
        args = [f"({c}*){_ARG[p]}" for c, p in (re.match(r"\s*(\w+)\*\s*__restrict__\s*(\w+)", q).groups()
                                                for q in params.split(","))]
        driver.append(f'extern "C" void run_{name}(void* x, void* w, void* y, int grid, int bdx, int bdy) {{\n'
                      f"    launch(grid, bdx, bdy, [&] {{ {name}({', '.join(args)}); }});\n}}\n")
    return build_harnessed(tmp_path / "kernels.cpp", body + "".join(driver), tmp_path / "kernels.so")


def _call(lib, sym, x, w, y, grid, warps):
    import ctypes
    vp = ctypes.c_void_p
    getattr(lib, f"run_{sym}_kernel")(vp(x.ctypes.data), vp(w.ctypes.data), vp(y.ctypes.data),
                                      ctypes.c_int(grid), ctypes.c_int(WARP), ctypes.c_int(warps))


def _wide(w: np.ndarray, dtype: str) -> np.ndarray:
    """float64 of fp16 weights or of bf16 bits (uint16)."""
    return w.astype(np.float64) if dtype == "float16" else (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


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
@pytest.mark.parametrize("qtype,k", [("q8_0", 352), ("q4_0", 608), ("q4_k", 1280), ("q6_k", 768), ("iq4_xs", 1280),
                                     ("mxfp4", 608)])
def test_quant_gemv_on_cpu_threads_rows_bitwise(tmp_path, qtype, k):
    pytest.importorskip("gguf")
    n = 13
    check = quant_rows
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


# ------------------------------------------------------------------------------------------------------------
# One launch, several outputs: shared x (q, k, v; gate, up), the residual add and SwiGLU epilogues.
# Each output must be bit-identical to the separate launches' (the GEMVs, then the stage's own elementwise
# kernels: TVM's CUDA for R.add and sigmoid-multiply-multiply, built by compile_gpu_stage's pipeline). The harness
# rounds every fp16 operation to fp16, as the GPU's half arithmetic does, so an epilogue rounding anywhere else
# than the elementwise kernel does would show.
# ------------------------------------------------------------------------------------------------------------
HALF_OPS = r"""
#define HALF_OP(OP) inline half operator OP(half a, half b) { return half((float)a OP (float)b); }
HALF_OP(+) HALF_OP(-) HALF_OP(*) HALF_OP(/)
inline half __float2half_rn(float f) { return half(f); }
inline half hexp(half a) { return half(std::exp((float)a)); }
"""


def _emulate_named(tmp_path, source: str):
    """(library, {kernel: its parameter names}); run_<kernel>(void** pointers in parameter order, grid, bdx, bdy)."""
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    drivers, params_of = [], {}
    for name, params in re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', body):
        typed = [re.match(r"\s*(\w+)\*\s*__restrict__\s*(\w+)_ptr", q).groups() for q in params.split(",")]
        params_of[name] = [p for _, p in typed]
        args = ", ".join(f"({c}*)a[{i}]" for i, (c, _) in enumerate(typed))
        drivers.append(f'extern "C" void run_{name}(void** a, int grid, int bdx, int bdy) {{\n'
                       f"    launch(grid, bdx, bdy, [&] {{ {name}({args}); }});\n}}\n")
    return build_harnessed(tmp_path / "named.cpp", HALF_OPS + body + "".join(drivers), tmp_path / "named.so"), params_of


def _run_named(emulated, kernel, arrays: dict, grid, bdx, bdy):
    """Runs `kernel` with arrays by parameter name; the one parameter not named is arrays["out"]."""
    import ctypes
    lib, params_of = emulated
    names = [p if p in arrays else "out" for p in params_of[kernel]]
    assert names.count("out") <= 1, names
    ptrs = (ctypes.c_void_p * len(names))(*[arrays[p].ctypes.data for p in names])
    getattr(lib, f"run_{kernel}")(ptrs, ctypes.c_int(grid), ctypes.c_int(bdx), ctypes.c_int(bdy))


def _elementwise_source(m: int, n: int) -> str:
    """The stage's own kernels for SwiGLU (sigmoid, multiply, multiply) and the residual add on fp16 [m, n]."""
    from tvm import relax
    bb = relax.BlockBuilder()
    g, u = (relax.Var(v, relax.TensorType((m, n), "float16")) for v in ("g", "u"))
    with bb.function("swiglu", [g, u]):
        with bb.dataflow():
            act = bb.emit(relax.op.multiply(g, bb.emit(relax.op.sigmoid(g))))
            out = bb.emit_output(relax.op.multiply(act, u))
        bb.emit_func_output(out)
    r, y = (relax.Var(v, relax.TensorType((m, n), "float16")) for v in ("r", "y"))
    with bb.function("resadd", [r, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(r, y))
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                                "max_threads_per_block": 1024, "thread_warp_size": 32}, host={"kind": "llvm"})
    ex = tvm.compile(bb.get(), target=target, relax_pipeline=cgs._gpu_relax_pipeline(target))
    return cgs._collect_cuda_sources(ex.mod)[0]


def _weights(rng, dtype, n, k):
    w32 = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    return w32.astype(np.float16) if dtype == "float16" else _bf16(w32)


def _same_bits(a, b) -> bool:
    assert np.isfinite(a.astype(np.float32)).all() and np.isfinite(b.astype(np.float32)).all()
    return np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_one_launch_primfuncs_and_bad_input():
    f = make_gpu_gemv(2, (4096, 1024, 1024), 4096, "bfloat16")
    assert f.attrs["global_symbol"] == "helmc_gpu_gemv_bf16_m2_n4096_1024_1024_k4096"
    assert [tuple(int(s) for s in p.shape) for p in f.params] == [(2, 4096), (4096, 4096), (1024, 4096),
                                                                  (1024, 4096), (2, 4096), (2, 1024), (2, 1024)]
    swiglu = make_gpu_gemv(1, 12288, 4096, "float16", epilogue="swiglu")
    assert swiglu.attrs["global_symbol"] == "helmc_gpu_gemv_swiglu_f16_m1_n12288_k4096"
    assert [tuple(int(s) for s in p.shape) for p in swiglu.params] == [(1, 4096), (12288, 4096), (12288, 4096),
                                                                       (1, 12288)]
    assert gemv_symbol(4, 64, 128, "float16", (2, 4, 2), "swiglu") == "helmc_gpu_gemv_swiglu_f16_m4_n64_k128"
    assert gemv_symbol(4, 64, 128, "float16", (2, 4, 2), "residual") == "helmc_gpu_gemv_res_f16_m4_n64_k128_r2w4u2"
    for args in ((4, 64, 128, "float16", (2, 4, 2), "residual"), (1, (4096, 1024, 1024), 4096, "bfloat16", None, None),
                 (2, 12288, 4096, "float16", None, "swiglu")):      # parse_gemv_symbol inverts gemv_symbol
        assert parse_gemv_symbol(gemv_symbol(*args)) == args, args
    assert parse_gemv_symbol(gemv_symbol(1, 64, 128, "float16", norm_eps=1e-6)) is None
    for bad in (dict(n=(8, 8, 8, 8)), dict(n=(8, 8), epilogue="swiglu"), dict(n=8, epilogue="gelu"),
                dict(n=(8, 12), k=12)):
        args = dict(n=8, k=64, epilogue=None) | bad
        with pytest.raises(HelmcError, match="GPU GEMV"):
            make_gpu_gemv(1, args["n"], args["k"], "float16", epilogue=args["epilogue"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("dtype,m,outs", [("float16", 1, (24, 8, 8)), ("bfloat16", 2, (13, 5)),
                                          ("float16", 4, (16, 13, 13)), ("bfloat16", 8, (13, 40))])
def test_one_launch_over_several_weights_equals_separate_launches(tmp_path, dtype, m, outs):
    k = 264                              # a last step past the row end
    fused = make_gpu_gemv(m, outs, k, dtype)
    alone = {n: make_gpu_gemv(m, n, k, dtype) for n in set(outs)}
    emulated = _emulate_named(tmp_path, _cuda_source({str(f.attrs["global_symbol"]): f
                                                      for f in [fused, *alone.values()]}))
    rng = np.random.default_rng(m)
    ws = [_weights(rng, dtype, n, k) for n in outs]
    x = rng.standard_normal((m, k)).astype(np.float16)
    rows, warps, _ = default_tuning(m)
    ys = [np.full((m, n), np.nan, np.float16) for n in outs]
    named = {"xv": x} | {f"wv{i}": w for i, w in enumerate(ws)} | {f"y{i}": y for i, y in enumerate(ys)}
    _run_named(emulated, f"{fused.attrs['global_symbol']}_kernel", named, sum(-(-n // rows) for n in outs), WARP,
               warps)
    for w, y, n in zip(ws, ys, outs):
        own = np.full((m, n), np.nan, np.float16)
        _run_named(emulated, f"{alone[n].attrs['global_symbol']}_kernel", {"xv": x, "wv": w, "y": own},
                   -(-n // rows), WARP, warps)
        assert _same_bits(y, own), (n, y, own)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_epilogues_equal_gemv_then_the_stages_elementwise_kernels(tmp_path, m):
    """swiglu: silu(x @ wg^T) * (x @ wu^T) as gate GEMV, up GEMV, the sigmoid-multiply kernel; residual: down GEMV
    then the add kernel; for bf16 weights too (the epilogue sees only the fp16 results)."""
    n, k = 13, 264
    funcs = [make_gpu_gemv(m, n, k, d, epilogue=e) for d in WEIGHT_DTYPES for e in (None, "swiglu", "residual")]
    source = _cuda_source({str(f.attrs["global_symbol"]): f for f in funcs})
    elementwise = _elementwise_source(m, n)
    emulated = _emulate_named(tmp_path, source + elementwise[elementwise.index('extern "C" __global__'):])
    assert "blockIdx" not in elementwise                    # one block of threads covers [m, n]
    bdx = -(-m * n // WARP) * WARP
    rng = np.random.default_rng(100 + m)
    x = (rng.standard_normal((m, k)) * 2).astype(np.float16)
    r = rng.standard_normal((m, n)).astype(np.float16)
    for dtype in WEIGHT_DTYPES:
        wg, wu = _weights(rng, dtype, n, k), _weights(rng, dtype, n, k)
        gemv = f"{gemv_symbol(m, n, k, dtype)}_kernel"
        rows, warps, _ = default_tuning(m)
        g, u = (np.full((m, n), np.nan, np.float16) for _ in range(2))
        _run_named(emulated, gemv, {"xv": x, "wv": wg, "y": g}, -(-n // rows), WARP, warps)
        _run_named(emulated, gemv, {"xv": x, "wv": wu, "y": u}, -(-n // rows), WARP, warps)
        want = np.full((m, n), np.nan, np.float16)
        _run_named(emulated, "fused_tir_sigmoid_multiply_multiply_kernel", {"g": g, "u": u, "out": want}, 1, bdx, 1)
        got = np.full((m, n), np.nan, np.float16)
        rows_s, warps_s, _ = default_tuning(m, "swiglu")
        _run_named(emulated, f"{gemv_symbol(m, n, k, dtype, epilogue='swiglu')}_kernel",
                   {"xv": x, "gv": wg, "uv": wu, "y": got}, -(-n // rows_s), WARP, warps_s)
        assert _same_bits(got, want), (dtype, got, want)
        ref = x.astype(np.float64) @ _wide(wg, dtype).T
        assert _rel(g, ref) < 2e-3 and len(np.unique(got)) > m * n // 2  # GEMVs right, outputs spread
        want = np.full((m, n), np.nan, np.float16)
        _run_named(emulated, "add_kernel", {"r": r, "y": g, "out": want}, 1, bdx, 1)
        got = np.full((m, n), np.nan, np.float16)
        _run_named(emulated, f"{gemv_symbol(m, n, k, dtype, epilogue='residual')}_kernel",
                   {"xv": x, "wv": wg, "r": r, "y": got}, -(-n // rows), WARP, warps)
        assert _same_bits(got, want), (dtype, got, want)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_norm_prologue_is_rms_norm_then_gemv_and_rows_bitwise(tmp_path, dtype):
    """The RMSNorm prologue (norm_eps): one weight, three weights of one x and swiglu, for m = 1 and 3, against
    float64 rms_norm(x) * g then the GEMV (and SwiGLU) within fp16 rounding; each row of the 3-row call is the
    1-row call's bits on that row alone. The prologue's x rows differ in scale by 100x: the norm is per row."""
    k, eps = 264, 1e-6
    forms = [((13,), None), ((13, 5, 5), None), ((13,), "swiglu")]
    funcs = [make_gpu_gemv(m, n if len(n) > 1 else n[0], k, dtype, epilogue=e, norm_eps=eps)
             for m in (1, 3) for n, e in forms]
    emulated = _emulate_named(tmp_path, _cuda_source({str(f.attrs["global_symbol"]): f for f in funcs}))
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, k)) * np.array([[1.0], [100.0], [0.01]])).astype(np.float16)
    g = (1 + 0.5 * rng.standard_normal(k)).astype(np.float16)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + eps) * g.astype(np.float64)
    worst = 0.0
    for n, epilogue in forms:
        ws = [_weights(rng, dtype, n_i, k) for n_i in (n[:1] * 2 if epilogue else n)]
        rows, warps, _ = default_tuning(1, epilogue)
        outs = {}
        for m in (1, 3):
            rows, warps, _ = default_tuning(m, epilogue)
            sym = gemv_symbol(m, n if len(n) > 1 else n[0], k, dtype, epilogue=epilogue, norm_eps=eps)
            ys = [np.full((m, n_i), np.nan, np.float16) for n_i in (n[:1] if epilogue else n)]
            named = {"xv": x[:m], "nv": g}
            if epilogue:
                named |= {"gv": ws[0], "uv": ws[1], "y": ys[0]}
            elif len(n) == 1:
                named |= {"wv": ws[0], "y": ys[0]}
            else:
                named |= {f"wv{i}": w for i, w in enumerate(ws)} | {f"y{i}": y for i, y in enumerate(ys)}
            if m == 1:
                per_row = []
                for t in range(3):
                    for y in ys:
                        y[:] = np.nan
                    _run_named(emulated, f"{sym}_kernel", named | {"xv": np.ascontiguousarray(x[t:t + 1])},
                               sum(-(-n_i // rows) for n_i in n), WARP, warps)
                    per_row.append([y.copy() for y in ys])
                outs[1] = [np.concatenate([r[i] for r in per_row]) for i in range(len(ys))]
            else:
                _run_named(emulated, f"{sym}_kernel", named, sum(-(-n_i // rows) for n_i in n), WARP, warps)
                outs[3] = ys
        for one, many in zip(outs[1], outs[3]):
            assert _same_bits(one, many), (n, epilogue)
        refs = [normed @ _wide(w, dtype).T for w in ws]
        if epilogue:
            gate, up = refs
            refs = [gate / (1 + np.exp(-gate)) * up]
        for got, ref in zip(outs[3], refs):
            worst = max(worst, _rel(got, ref))
    print(f"\nGEMV with the RMSNorm prologue ({dtype}): max relative error {worst:.2e} against float64 rms_norm + "
          f"GEMV; rows of the 3-row call bit-identical to 1-row calls")
    assert worst < 5e-3
