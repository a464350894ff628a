"""The GPU's two-launch MoE expert kernels (schedules/gpu/moe_experts.py) without a GPU: their generated CUDA
compiled with g++ against test_gpu_quant_kernels' harness (a std::thread per CUDA thread), blockIdx.y looping
over the selected experts. Reference: float64 on gguf's dequantization of the same stacked rows, x and each
expert's SwiGLU output int8-quantized per 32 as the kernels do (test_gpu_int8_gemv_kernels.quantize_x); the
tolerance is that test's (fp32 sums, fp16 outputs). Experts are picked out of order and not all of them, so a
CTA reading another expert's rows is a large error."""
from __future__ import annotations

import ctypes
import re
import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
gguf_quants = pytest.importorskip("gguf.quants")

from helmc.compiler.passes import compile_gpu_stage as cgs  # noqa: E402
from helmc.runtime.function_names import gpu_moe_names  # noqa: E402
from helmc.schedules.gpu.moe_experts import make_gpu_moe_kernels  # noqa: E402
from helmc.schedules.gpu.quant_gemv_int8 import WARPS, int8_kernel_parts  # noqa: E402
from test_gpu_int8_gemv_kernels import quantize_x  # noqa: E402
from test_gpu_gemv_kernels import HALF_OPS  # noqa: E402
from test_gpu_quant_kernels import build_harnessed  # noqa: E402
from test_cpu_quant_gemv import GGML, random_quant_weight  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _emulate(tmp_path, funcs: dict):
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                                "max_threads_per_block": 1024, "thread_warp_size": 32}, host={"kind": "llvm"})
    source = cgs._collect_cuda_sources(tvm.compile(tvm.IRModule(funcs), target=target).mod)[0]
    body = source[source.index('extern "C" __global__'):].replace("__shared__ alignas(64)", "alignas(64) static")
    drivers, params = [], {}
    for name, plist in dict(re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', body)).items():
        params[name] = [p.split()[-1] for p in plist.split(",")]
        args = []
        ptr_i = 0
        for p in plist.split(","):
            if "*" in p:
                ctype = re.match(r"\s*(\w+)\*", p).group(1)
                args.append(f"({ctype}*)ptrs[{ptr_i}]")
                ptr_i += 1
            else:
                args.append("n")
        drivers.append(f'extern "C" void run_{name}(void** ptrs, int n, int gx, int bdy) {{\n'
                       f"    for (int by = 0; by < n; ++by)\n"
                       f"        launch(gx, 32, bdy, [&] {{ blockIdx.y = by; {name}({', '.join(args)}); }});\n}}\n")
    return build_harnessed(tmp_path / "moe.cpp", HALF_OPS + body + "".join(drivers), tmp_path / "moe.so"), params


def _run(lib, params, name, arrays: dict, n: int, grid: int):
    """Kernel `name`'s pointer parameters (x_ptr, ...) from arrays by name, in the generated order."""
    ptrs = [arrays[p[:-len("_ptr")]].ctypes.data for p in params[name] if p.endswith("_ptr")]
    getattr(lib, f"run_{name}")((ctypes.c_void_p * len(ptrs))(*ptrs), ctypes.c_int(n), ctypes.c_int(grid),
                                ctypes.c_int(WARPS))


@pytest.mark.parametrize("gate_type,down_type", [("q4_k", "q6_k"), ("q6_k", "q4_k"), ("q5_k", "q6_k"),
                                                  ("q3_k", "q5_k")])
def test_selected_experts_match_float64(tmp_path, gate_type, down_type):
    E, I, H, K = 5, 256, 512, 3
    rng = np.random.default_rng(7)
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))     # [E * I, row bytes]
    down = random_quant_weight(rng, down_type, E * H, I)                              # [E * H, row bytes]
    x = (rng.standard_normal((1, H)) * 0.05).astype(np.float16)         # |a| well inside fp16
    lib, params = _emulate(tmp_path, make_gpu_moe_kernels(gate_type, down_type, E, I, H, K))
    gate_up_name, down_name = (s + "_kernel" for s in gpu_moe_names(gate_type, down_type, E, I, H))
    sel = np.array([4, 1, 2], np.int32)
    a = np.zeros((K, I), np.float16)
    part = np.zeros((K, H), np.float16)
    arrays = dict(x=x, sel=sel, w_gate=gate, w_up=up, w_down=down, a=a, part=part)
    _run(lib, params, gate_up_name, arrays, 2, int8_kernel_parts(gate_type, I, H, epilogue="swiglu")[1])
    _run(lib, params, down_name, arrays, 2, int8_kernel_parts(down_type, H, I)[1])
    deq = lambda raw, t: gguf_quants.dequantize(raw, GGML[t]).astype(np.float64)   # noqa: E731
    x8 = quantize_x(x)[0]
    for j, e in enumerate(sel[:2]):
        g = deq(gate[e * I:(e + 1) * I], gate_type) @ x8
        u = deq(up[e * I:(e + 1) * I], gate_type) @ x8
        ref_a = g / (1 + np.exp(-g)) * u
        err_a = np.abs(a[j].astype(np.float64) - ref_a).max() / np.abs(ref_a).max()
        ref_p = deq(down[e * H:(e + 1) * H], down_type) @ quantize_x(a[j:j + 1])[0]
        err_p = np.abs(part[j].astype(np.float64) - ref_p).max() / np.abs(ref_p).max()
        print(f"{gate_type}/{down_type} expert {e}: swiglu rel err {err_a:.1e}, down {err_p:.1e}")
        assert err_a < 1e-2 and err_p < 2e-3, (e, err_a, err_p)
    assert not a[2].any() and not part[2].any()          # n = 2: the third slot untouched


@pytest.mark.parametrize("gate_type,down_type", [("q4_k", "q6_k")])
def test_rows_kernels_equal_the_one_row_kernels_per_row(tmp_path, gate_type, down_type):
    """A batched step's pairs (make_gpu_moe_rows_kernels): each pair's a and part are the one-row kernels' bits on
    that pair's row alone; rows share experts and pick others, so a CTA reading another row's x is a changed bit."""
    from helmc.runtime.function_names import gpu_moe_rows_names
    from helmc.schedules.gpu.moe_experts import make_gpu_moe_rows_kernels
    E, I, H, K = 5, 256, 256, 2
    rng = np.random.default_rng(11)
    gate, up = (random_quant_weight(rng, gate_type, E * I, H) for _ in range(2))
    down = random_quant_weight(rng, down_type, E * H, I)
    x = (rng.standard_normal((3, H)) * 0.05).astype(np.float16)                      # m = 3 rows
    funcs = {**make_gpu_moe_kernels(gate_type, down_type, E, I, H, K),
             **make_gpu_moe_rows_kernels(gate_type, down_type, E, I, H)}
    lib, params = _emulate(tmp_path, funcs)
    one_up, one_down = (s + "_kernel" for s in gpu_moe_names(gate_type, down_type, E, I, H))
    rows_up, rows_down = (s + "_kernel" for s in gpu_moe_rows_names(gate_type, down_type, E, I, H))
    up_grid, down_grid = int8_kernel_parts(gate_type, I, H, epilogue="swiglu")[1], int8_kernel_parts(down_type, H, I)[1]
    sel = np.array([4, 1, 1, 3, 0, 4], np.int32)                                     # [n] pairs' experts
    row = np.array([0, 0, 1, 1, 2, 2], np.int32)                                     # [n] their rows
    a = np.zeros((6, I), np.float16)
    part = np.zeros((6, H), np.float16)
    arrays = dict(x=x, sel=sel, row=row, w_gate=gate, w_up=up, w_down=down, a=a, part=part)
    _run(lib, params, rows_up, arrays, 6, up_grid)
    _run(lib, params, rows_down, arrays, 6, down_grid)
    assert a.any() and part.any()
    for r in range(3):
        a1, p1 = np.zeros((K, I), np.float16), np.zeros((K, H), np.float16)
        one = dict(x=np.ascontiguousarray(x[r:r + 1]), sel=sel[2 * r:2 * r + 2].copy(), w_gate=gate, w_up=up,
                   w_down=down, a=a1, part=p1)
        _run(lib, params, one_up, one, K, up_grid)
        _run(lib, params, one_down, one, K, down_grid)
        assert np.array_equal(a[2 * r:2 * r + 2].view(np.uint16), a1.view(np.uint16)), r
        assert np.array_equal(part[2 * r:2 * r + 2].view(np.uint16), p1.view(np.uint16)), r
