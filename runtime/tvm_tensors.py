"""NumPy <-> TVM runtime tensors, including bf16 without ml_dtypes, and the CPU thread count.

Imports only numpy and tvm.runtime, so it works with the runtime-only TVM on the GPU machine.

bf16 convention: NumPy has no bfloat16, so a bf16 tensor travels as a uint16 array of its raw bits
(what safetensors' BF16 bytes are). `tensor_from_numpy(bits, "bfloat16", dev)` makes a TVM tensor of dtype
bfloat16 from them -- the dtype the Relax ONNX importer gives a BFLOAT16 graph input -- and
`numpy_from_tensor` gives the bits back as uint16.
"""
from __future__ import annotations

import os

import numpy as np
import tvm.runtime

_NUMPY_DTYPES = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "bool"}


def tensor_from_numpy(arr: np.ndarray, dtype: str, device) -> tvm.runtime.Tensor:
    """A new tensor on `device` holding `arr`. dtype "bfloat16" takes a uint16 array of raw bf16 bits;
    any other dtype must equal the array's own (no silent conversion)."""
    arr = np.ascontiguousarray(arr)
    if dtype == "bfloat16":
        if arr.dtype != np.uint16:
            raise TypeError(f"bfloat16 tensor: expected a uint16 array of raw bits, found {arr.dtype}")
        out = tvm.runtime.empty(arr.shape, "bfloat16", device)
        # Copy through a uint16 view of the same memory: Tensor.copyfrom on a bf16 tensor would first make
        # a flattened copy of the whole array (twice the memory for a multi-GB weight).
        out._create_view(arr.shape, "uint16").copyfrom(arr)
        return out
    if dtype not in _NUMPY_DTYPES or np.dtype(dtype) != arr.dtype:
        raise TypeError(f"tensor_from_numpy: dtype {dtype!r} expected to match the array's, found {arr.dtype}")
    out = tvm.runtime.empty(arr.shape, dtype, device)
    out.copyfrom(arr)
    return out


def numpy_from_tensor(t: tvm.runtime.Tensor) -> np.ndarray:
    """The tensor's contents on the host; bf16 comes back as uint16 raw bits (see module docstring)."""
    if str(t.dtype) == "bfloat16":
        return t._create_view(tuple(int(d) for d in t.shape), "uint16").numpy()
    return t.numpy()


def host_view(t: tvm.runtime.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory, no copy (the view keeps the tensor alive). The CPU stage's per-block
    activations cross this way: Tensor.numpy() allocates and copies, ~5 us of Python a call where a Qwen3-8B
    block's decode step makes four such crossings; a dtype NumPy lacks (bfloat16) is copied as numpy() does."""
    try:
        return np.from_dlpack(t)
    except (BufferError, TypeError, ValueError, RuntimeError):
        return t.numpy()


def cpu_tensor_view(arr: np.ndarray, device) -> tvm.runtime.Tensor:
    """A CPU tensor over `arr`'s memory when it is C-contiguous and 64-byte aligned (what TVM takes without a copy;
    the tensor keeps `arr` alive), else a new tensor holding a copy. The caller must not write `arr` while the tensor
    is in use."""
    if arr.flags.c_contiguous and arr.ctypes.data % 64 == 0 and arr.dtype.name in _NUMPY_DTYPES:
        return tvm.runtime.from_dlpack(arr)
    return tvm.runtime.tensor(np.ascontiguousarray(arr), device)


def bf16_bits_from_float32(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 raw bits (uint16), as torch's .to(torch.bfloat16) does."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def float32_from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def use_cpu_threads(count: int) -> None:
    """Make TVM's CPU kernels run on `count` threads. Call before the first kernel runs.

    TVM's default is hardware_concurrency / 2 on x86 (it assumes hyper-threading), which on a machine
    without SMT leaves half the cores idle and halves the GEMV's bandwidth (measured on the 2-core EPYC:
    one thread 12-13 GB/s, two 21-24 GB/s). The runtime reads TVM_NUM_THREADS when it creates its pool.
    """
    if count < 1:
        raise ValueError(f"use_cpu_threads: expected a positive thread count, found {count}")
    os.environ["TVM_NUM_THREADS"] = str(count)


def available_cpu_count() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity, unlike os.cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_BLAS_THREAD_SETTERS = ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                        "scipy_openblas_set_num_threads64_", "MKL_Set_Num_Threads")


def single_threaded_blas() -> int:
    """Make the BLAS under NumPy run each call on one thread; returns how many BLAS libraries were set.

    The CPU KV cache runs attention on its own thread pool (one NumPy matmul per worker) right after
    TVM's kernels, whose pool threads spin on every core for a while. A multi-threaded BLAS under
    that oversubscribes the cores: measured on the 16-core GPU machine, decode at 8K context ran
    1.15 tok/s with OpenBLAS's default threads and 6.10 tok/s with one. Uses threadpoolctl where it
    is installed; otherwise calls the setter of each BLAS library already loaded into this process.
    """
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1, user_api="blas")
        return 1
    except ImportError:
        pass
    import ctypes
    done = 0
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "blas" in line.lower() and ".so" in line}
    except OSError:
        return 0
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _BLAS_THREAD_SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                done += 1
                break
    return done
