"""Run a prebuilt GPU stage with the runtime-only TVM: CUDA backend loading, prebuilt cubins, DLPack, uploads.

The GPU stage's host library (from helmc.compiler.passes.compile_gpu_stage) carries its kernels as CUDA source;
when it is loaded, TVM asks the global `tvm_callback_cuda_compile(source)` for machine code. The
target has no CUDA compiler, so the callback registered here answers with the cubin built with
the bundle, found by the source's sha256, and refuses anything else (a source that does not match
means the library and the cubin come from different builds).

Imports only numpy, tvm.runtime / tvm_ffi, and cupy lazily: never torch, onnx or the TVM compiler.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import sys
import threading

import numpy as np

from helmc.errors import HelmcError

CUBIN_INDEX_FORMAT_VERSION = 1
CUDA_COMPILE_CALLBACK = "tvm_callback_cuda_compile"

# sha256(CUDA source) -> cubin path, over every stage loaded in this process.
_cubins: dict[str, str] = {}
_lock = threading.Lock()
_callback_registered = False


class CudaRuntimeError(HelmcError, RuntimeError):
    """The GPU stage cannot be loaded or run here; the message names expected vs found. A HelmcError (a wrong GPU
    or driver is the machine's state, not a bug: one typed line from the CLI), and still a RuntimeError for callers."""


# ------------------------------------------------------------------------------------------------
# Backend loading
# ------------------------------------------------------------------------------------------------
def _cudart_candidates() -> list[str]:
    pats = ["/usr/local/cuda/lib64/libcudart.so.1*", "/usr/local/cuda-*/lib64/libcudart.so.1*",
            "/usr/local/cuda-*/lib/libcudart.so.1*"]
    # Reads sys.path (edits nothing): a GPU machine without a CUDA toolkit has libcudart only in the pip wheel
    # (nvidia-cuda-runtime) under site-packages, which the runtime-only TVM's CUDA backend must load by path.
    for p in sys.path:
        pats += [os.path.join(p, "nvidia", "cu1*", "lib", "libcudart.so.1*"),
                 os.path.join(p, "nvidia", "cuda_runtime", "lib", "libcudart.so.1*")]
    found = []
    for pat in pats:
        found += sorted(glob.glob(pat))
    return found


def ensure_cuda_backend() -> None:
    """Make TVM's CUDA device API and module loader available (runtime-only mode loads no backend)."""
    import tvm.runtime

    if tvm.runtime.enabled("cuda"):
        return
    import tvm

    lib = os.path.join(os.path.dirname(os.path.abspath(tvm.__file__)), "lib", "libtvm_runtime_cuda.so")
    if not os.path.isfile(lib):
        raise CudaRuntimeError(f"TVM CUDA runtime: expected {lib}, found no such file (is this TVM built with CUDA?)")
    try:
        ctypes.CDLL(lib, ctypes.RTLD_GLOBAL)
    except OSError as first:
        if "libcudart" not in str(first):
            raise CudaRuntimeError(f"TVM CUDA runtime: could not load {lib}: {first}") from None
        # libcudart lives outside the default search path (a CUDA wheel, /usr/local/cuda): preload it.
        for cand in _cudart_candidates():
            try:
                ctypes.CDLL(cand, ctypes.RTLD_GLOBAL)
                ctypes.CDLL(lib, ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        else:
            raise CudaRuntimeError(f"TVM CUDA runtime: could not load {lib}: {first}; "
                                   f"no loadable libcudart among {_cudart_candidates()}") from None
    if not tvm.runtime.enabled("cuda"):
        raise CudaRuntimeError(f"TVM CUDA runtime: loaded {lib} but the 'cuda' device is still not registered")


# ------------------------------------------------------------------------------------------------
# Prebuilt cubins
# ------------------------------------------------------------------------------------------------
def prebuilt_cubin_for(source: str) -> bytes:
    """The cubin registered for this CUDA source; CudaRuntimeError if none matches."""
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    with _lock:
        path = _cubins.get(digest)
        known = sorted(_cubins)
    if path is None:
        raise CudaRuntimeError(
            f"no prebuilt cubin for this CUDA source: expected its sha256 among {known}, found {digest}; "
            "the GPU stage library and its cubin index come from different builds, rebuild the bundle")
    with open(path, "rb") as f:
        return f.read()


def _compile_callback(source, *_rest):
    return prebuilt_cubin_for(str(source))


def register_cubin_index(index_path: str) -> dict:
    """Read a cubin index (compile_gpu_stage's <name>.cubins.json) and register its cubins."""
    global _callback_registered
    try:
        with open(index_path) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CudaRuntimeError(f"cubin index: expected {index_path}, found no such file") from None
    if index.get("format_version") != CUBIN_INDEX_FORMAT_VERSION:
        raise CudaRuntimeError(f"cubin index {index_path}: format_version expected {CUBIN_INDEX_FORMAT_VERSION}, "
                               f"found {index.get('format_version')!r}")
    base = os.path.dirname(os.path.abspath(index_path))
    entries = {}
    for digest, name in index["cubins"].items():
        path = os.path.join(base, name)
        if not os.path.isfile(path):
            raise CudaRuntimeError(f"cubin index {index_path}: expected cubin {path}, found no such file")
        entries[digest] = path
    with _lock:
        _cubins.update(entries)
        if not _callback_registered:
            import tvm_ffi

            tvm_ffi.register_global_func(CUDA_COMPILE_CALLBACK, _compile_callback, override=True)
            _callback_registered = True
    return index


PREFILL_GEMM_FUNC = "helmc.gemm_nt_f16"     # compiler.passes.dispatch_prefill_gemm.GEMM_FUNC
_gemm_registered = False


_cublas = None        # (cupy, its cuBLAS binding, host alpha / beta) once the first GEMM has found them


def _gemm_nt_f16(x, w, y) -> None:
    """y[seq, N] = x[seq, K] @ w[N, K]^T in fp16 with fp32 sums: cuBLAS's tensor-core GEMM (the call CuPy's matmul
    makes for fp16, without its arrays: ~7 prefill GEMMs per block made a 128-token prompt host-bound), on CuPy's
    current stream (the session runs TVM and CuPy work on one stream). The prefill functions call it per linear.
    Row-major y = x w^T is column-major y^T = op_T(w) x^T: m = N, n = seq, k = K, leading dimensions K, K, N."""
    global _cublas
    if _cublas is None:
        import cupy as cp
        from cupy_backends.cuda.libs import cublas
        _cublas = (cp, cublas, np.ones(1, np.float32), np.zeros(1, np.float32))
    cp, cublas, one, zero = _cublas
    (M, K), N = x.shape, w.shape[0]
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    f16 = cp.cuda.runtime.CUDA_R_16F
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, M, K, one.ctypes.data, w.data_ptr(), f16, K,
                  x.data_ptr(), f16, K, zero.ctypes.data, y.data_ptr(), f16, N, cublas.CUBLAS_COMPUTE_32F,
                  cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)


def register_prefill_gemm() -> None:
    """Make helmc.gemm_nt_f16 known to TVM before a GPU stage that calls it is loaded."""
    global _gemm_registered
    with _lock:
        if not _gemm_registered:
            import tvm_ffi

            tvm_ffi.register_global_func(PREFILL_GEMM_FUNC, _gemm_nt_f16, override=True)
            _gemm_registered = True


def check_device_arch(arch: str, device_id: int = 0) -> None:
    """A cubin runs only on its own major.minor: fail clearly instead of at the first launch."""
    import tvm.runtime

    dev = tvm.runtime.cuda(device_id)
    if not dev.exist:
        raise CudaRuntimeError(f"GPU stage: expected CUDA device {device_id}, found none")
    found = "sm_" + str(dev.compute_version).replace(".", "")
    if found != arch.rstrip("a"):
        raise CudaRuntimeError(f"GPU stage was built for {arch}, found a {dev.device_name} ({found}); "
                               "rebuild the bundle for this GPU (hardware.json gpu.arch)")


def load_gpu_executable(lib_path: str, cubin_index_path: str, device_id: int = 0):
    """Load a GPU stage built by compile_gpu_stage: the library module, ready for
    `tvm.runtime.vm.VirtualMachine(module, tvm.runtime.cuda(device_id))` (load_gpu_vm does both)."""
    import tvm.runtime

    ensure_cuda_backend()
    register_prefill_gemm()
    index = register_cubin_index(cubin_index_path)
    check_device_arch(index["arch"], device_id)
    if not os.path.isfile(lib_path):
        raise CudaRuntimeError(f"GPU stage: expected library {lib_path}, found no such file")
    from helmc.runtime.bundle.library import load_library
    return load_library(lib_path)            # a bundle's is a verified private copy (bundle/library.py)


def load_gpu_vm(lib_path: str, cubin_index_path: str, device_id: int = 0):
    """A Relax VM over the GPU stage on cuda(device_id)."""
    import tvm.runtime
    from tvm.runtime.vm import VirtualMachine

    return VirtualMachine(load_gpu_executable(lib_path, cubin_index_path, device_id), tvm.runtime.cuda(device_id))


# ------------------------------------------------------------------------------------------------
# Zero-copy exchange with CuPy, and TVM's stream
# ------------------------------------------------------------------------------------------------
def cupy_to_tvm(a, dtype: str | None = None):
    """A TVM tensor over the CuPy array's memory (no copy). `dtype` reinterprets the bytes
    (e.g. "bfloat16" for raw uint16 bits, which CuPy has no type for); the array must be contiguous."""
    import tvm.runtime

    t = tvm.runtime.from_dlpack(a)
    if dtype is not None and dtype != str(t.dtype):
        if np.dtype(a.dtype).itemsize != 2 and dtype == "bfloat16":
            raise CudaRuntimeError(f"cupy_to_tvm: bfloat16 view needs 2-byte elements, found {a.dtype}")
        t = t._create_view(t.shape, dtype)
    return t


def tvm_to_cupy(t):
    """A CuPy array over the TVM tensor's memory (no copy). bfloat16 comes back as raw uint16 bits."""
    import cupy as cp

    if str(t.dtype) == "bfloat16":
        t = t._create_view(t.shape, "uint16")
    return cp.from_dlpack(t)


def capture_graph(stream, body):
    """(graph, pool, out): body() captured on the CuPy `stream` as a CUDA graph, not run (the caller launches it),
    its CuPy temporaries from `pool`, a memory pool of the graph's own that must live as long as the graph. Raises
    what the capture raised; a failed capture enqueued nothing. Shared by decode_graph.DecodeGraph and
    hybrid/group_graph.GroupGraph."""
    import cupy as cp
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        stream.begin_capture()
        try:
            out = body()
        finally:
            graph = stream.end_capture()
    return graph, pool, out


def tvm_stream(stream, device_id: int = 0):
    """Context manager: TVM launches on this CuPy stream (tvm_ffi's environment stream)."""
    import tvm_ffi
    import tvm.runtime

    return tvm_ffi.use_raw_stream(tvm.runtime.cuda(device_id), stream.ptr)


# ------------------------------------------------------------------------------------------------
# Weight upload: host views (mmapped safetensors) -> device, through reused pinned staging
# ------------------------------------------------------------------------------------------------
class PinnedUploader:
    """Streams host arrays to new device arrays through two reused pinned staging buffers.

    Invariants: each staging buffer is `chunk_bytes` long and page-locked; a buffer is refilled
    only after the copy that last read it has completed (its event), so a host memcpy into one
    buffer overlaps the DMA out of the other. Never holds more than 2 * chunk_bytes of host memory,
    whatever the tensor sizes (no full host copy of a checkpoint).
    """

    def __init__(self, chunk_bytes: int = 64 << 20, stream=None):
        import cupy as cp

        assert chunk_bytes > 0 and chunk_bytes % 256 == 0, chunk_bytes
        self._cp = cp
        self.chunk_bytes = chunk_bytes
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        from helmc.runtime.memory.allocation import allocate
        self._pinned = [allocate("pinned", chunk_bytes, lambda: cp.cuda.alloc_pinned_memory(chunk_bytes), "upload staging")
                        for _ in range(2)]
        self._staging = [np.frombuffer(p, np.uint8, chunk_bytes) for p in self._pinned]
        self._events = [None, None]
        self._next = 0
        self.bytes_uploaded = 0

    def upload(self, src: np.ndarray, dtype: str | None = None, dev=None):
        """A new device array holding `src` (any layout; copied as C-contiguous bytes).

        Returns a CuPy array, or with `dtype` (the checkpoint's: "float16", "bfloat16" for raw uint16
        bits, ...) a TVM tensor of that dtype over it; so `upload` fits weights.bind_layers'
        to_device(view, dtype, dev). `dev`, if given, must be the current CuPy device.
        The copy is asynchronous on self.stream: call synchronize() (or close()) before any other
        stream reads the data.
        """
        cp = self._cp
        if dev is not None and getattr(dev, "index", getattr(dev, "device_id", 0)) != cp.cuda.Device().id:
            raise CudaRuntimeError(f"PinnedUploader.upload: expected the current CUDA device {cp.cuda.Device().id}, "
                                   f"found {dev}")
        from helmc.runtime.memory.allocation import allocate
        src = np.ascontiguousarray(src)
        dst = allocate("weights", src.nbytes, lambda: cp.empty(src.shape, src.dtype))
        self.upload_into(dst, src)
        return dst if dtype is None else cupy_to_tvm(dst, dtype)

    def upload_into(self, dst, src: np.ndarray) -> None:
        """Copy host `src` into the existing contiguous device array `dst` (same byte size)."""
        cp = self._cp
        src = np.ascontiguousarray(src)
        if dst.nbytes != src.nbytes or not dst.flags.c_contiguous:
            raise CudaRuntimeError(f"upload_into: expected a contiguous device array of {src.nbytes} bytes, "
                                   f"found {dst.nbytes} bytes (contiguous={dst.flags.c_contiguous})")
        flat = src.reshape(-1).view(np.uint8)                                  # [*shape] -> [nbytes]
        dptr = dst.data.ptr
        for start in range(0, flat.size, self.chunk_bytes):
            n = min(self.chunk_bytes, flat.size - start)
            i = self._next
            self._next = 1 - i
            if self._events[i] is not None:
                self._events[i].synchronize()          # the DMA that last read buffer i is done
            self._staging[i][:n] = flat[start:start + n]
            cp.cuda.runtime.memcpyAsync(dptr + start, self._staging[i].ctypes.data, n,
                                        cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.stream)
            self._events[i] = ev
        self.bytes_uploaded += flat.size

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        self._staging, self._pinned, self._events = [], [], [None, None]
