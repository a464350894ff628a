"""benchmarks/bench_cpu_gemv.py's WeightArena: weight copies are placed in order, 4 KiB-aligned, inside the one
allocation whose first bytes the DRAM read covers, hold what was copied in, and a full arena says so."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("tvm")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_cpu_gemv as bench  # noqa: E402


def test_copies_are_placed_in_order_and_hold_their_values():
    from helmc.runtime.weights.host_memory import cpu_tensor_over
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, numpy_from_tensor
    arena = bench.WeightArena(bench.arena_bytes(64 << 10, [3 * 96 * 100 * 2]))
    base = arena.region.ctypes.data
    rng = np.random.default_rng(0)
    copies, w64 = bench.weight_copies(rng, 96, 100, "bfloat16", 3 * 96 * 100 * 2, arena)
    assert len(copies) == 3
    starts = [c.data_ptr() - base for c in copies]
    assert starts == [0, 20480, 40960]              # 19200 bytes each, rounded up to 4 KiB
    for c in copies:
        np.testing.assert_array_equal(numpy_from_tensor(c), bf16_bits_from_float32(w64.astype(np.float32)))
    read = cpu_tensor_over(arena.region, (16 << 10,), "float32")   # the DRAM read's view: same first pages
    assert read.data_ptr() == copies[0].data_ptr()
    again, _ = bench.weight_copies(rng, 96, 100, "float16", 1, arena)   # reset: placed from the start again
    assert again[0].data_ptr() == base and str(again[0].dtype) == "float16"


def test_a_full_arena_names_the_sizes():
    arena = bench.WeightArena(8192)
    arena.tensor((1024,), "float32")
    with pytest.raises(ValueError, match="8192 bytes expected to fit at offset 4096, found 8192 bytes in all"):
        arena.tensor((1024, 2), "float32")


def test_quantized_copies_need_only_the_runtime():
    """--run-only runs where TVM is runtime-only (the GPU machine): making its quantized weight rows must import
    nothing of the TVM compiler (`tvm.script` must not come in through the GPU kernels' format table)."""
    import subprocess
    pytest.importorskip("gguf")
    code = ("import sys, numpy as np; "
            "from tests.quant_rows import random_quant_rows; "
            "print([random_quant_rows(q, 2, 256, np.random.default_rng(0)).shape for q in ('q4_0', 'q4_k', 'q6_k')]); "
            "assert not [m for m in sys.modules if m.startswith(('tvm.script', 'tvm.relax', 'helmc.schedules'))]")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TVM_USE_RUNTIME_LIB": "1", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[(2, 144), (2, 144), (2, 210)]" in r.stdout, r.stdout
