"""runtime/weights/host_memory.py: huge-page-advised CPU tensors hold what was copied in, at 2 MiB-aligned addresses,
and stay valid after every other reference to their mapping is gone."""
from __future__ import annotations

import gc

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from helmc.runtime.weights.host_memory import (HUGE_PAGE, MIN_HUGE_BYTES, anon_huge_page_bytes,  # noqa: E402
                                       cpu_tensor_from_numpy, cpu_tensor_over, huge_page_buffer)
from helmc.runtime.tvm_tensors import numpy_from_tensor  # noqa: E402


def test_huge_page_buffer_is_aligned_and_sized():
    buf = huge_page_buffer(3 * HUGE_PAGE + 123)
    assert buf.ctypes.data % HUGE_PAGE == 0 and buf.nbytes == 3 * HUGE_PAGE + 123
    with pytest.raises(ValueError, match="positive size"):
        huge_page_buffer(0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cpu_tensor_from_numpy_round_trips_large_and_small(dtype):
    rng = np.random.default_rng(1)
    for rows in (MIN_HUGE_BYTES // (1024 * 2) + 7, 3):       # over the huge-page threshold, and far under
        vals = rng.standard_normal((rows, 1024), dtype=np.float32)
        arr = vals.view(np.uint32).astype(np.uint16) if dtype == "bfloat16" else vals.astype(dtype)
        t = cpu_tensor_from_numpy(arr, dtype)
        del vals
        gc.collect()
        assert str(t.dtype) == dtype and tuple(t.shape) == arr.shape
        np.testing.assert_array_equal(numpy_from_tensor(t), arr)
        if arr.nbytes >= MIN_HUGE_BYTES:
            assert t.data_ptr() % HUGE_PAGE == 0


def test_cpu_tensor_over_views_the_region_in_place():
    region = huge_page_buffer(4 * 4096, advise=False)
    region[:] = 0
    t = cpu_tensor_over(region[4096:], (8, 16), "bfloat16")        # [8 * 16 * 2 bytes] of the region
    assert t.data_ptr() == region.ctypes.data + 4096 and str(t.dtype) == "bfloat16"
    region[4096:4098] = (0x80, 0x3F)                                # bf16 bits 0x3f80 = 1.0, little-endian
    assert numpy_from_tensor(t)[0, 0] == 0x3F80
    with pytest.raises(ValueError, match=">= 1024 bytes"):
        cpu_tensor_over(region[:1000], (16, 16), "float32")
    with pytest.raises(ValueError, match="alignment 8"):
        cpu_tensor_over(region[8:], (4,), "float32")


def test_cpu_tensor_from_numpy_rejects_a_dtype_mismatch():
    with pytest.raises(TypeError, match="expected to match"):
        cpu_tensor_from_numpy(np.zeros((MIN_HUGE_BYTES // 4,), np.float32), "float16")


def test_anon_huge_page_bytes_reads_a_count():
    assert anon_huge_page_bytes() >= 0


def test_host_view_and_cpu_tensor_view_share_memory_or_copy():
    """The CPU stage's activation crossings (runtime/tvm_tensors.py): a view both ways where TVM allows one (the same
    memory: a write through one is seen by the other), a copy where it does not (unaligned, non-contiguous), and
    bf16 (which NumPy lacks) back as raw uint16 bits by copy."""
    from helmc.runtime.tvm_tensors import cpu_tensor_view, host_view, tensor_from_numpy
    dev = tvm.cpu()
    t = tensor_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4), "float32", dev)
    v = host_view(t)
    assert v.shape == (2, 4) and v.dtype == np.float32 and not v.flags.owndata
    t.copyfrom(np.full((2, 4), 5.0, np.float32))
    assert (v == 5.0).all()                                           # the view is the tensor's memory
    raw = np.empty(4 * 64 + 64, np.uint8)
    start = -raw.ctypes.data % 64
    aligned = raw[start:start + 4 * 64].view(np.float32).reshape(4, 16)
    aligned[:] = 1.5
    tv = cpu_tensor_view(aligned, dev)
    aligned[0, 0] = 7.0
    assert tv.numpy()[0, 0] == 7.0 and tuple(tv.shape) == (4, 16)    # zero-copy: the same memory
    unaligned = raw[start + 4:start + 4 + 4 * 60].view(np.float32)
    unaligned[:] = 2.0
    tc = cpu_tensor_view(unaligned, dev)
    unaligned[0] = 9.0
    assert tc.numpy()[0] == 2.0                                       # a copy: TVM needs 64-byte alignment
    strided = np.arange(32, dtype=np.float32).reshape(4, 8)[:, ::2]
    assert (cpu_tensor_view(strided, dev).numpy() == strided).all()   # non-contiguous: copied, values kept
    bits = np.array([[0x3F80, 0x4000]], np.uint16)                    # bf16 1.0, 2.0
    assert (host_view(tensor_from_numpy(bits, "bfloat16", dev)).view(np.uint16) == bits).all()
