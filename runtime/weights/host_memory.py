"""Host tensors whose pages the kernel may back with 2 MiB transparent huge pages.

Why: the CPU stage streams every weight once per token. With THP in "madvise" mode (the GPU machine's
setting) a plain allocation gets 4 KiB pages, one TLB entry per 4 KiB streamed; an anonymous mapping
advised with MADV_HUGEPAGE before its first touch gets 2 MiB pages where the kernel has them free.

Only whole 2 MiB-aligned huge pages inside the tensor are advised: its tail stays on 4 KiB pages, so no
tensor makes more than its own bytes resident. Where THP is off, or madvise fails, the memory is ordinary
anonymous memory and everything works the same. Imports only numpy, mmap and tvm.runtime.

Used by the CPU benches (--huge-pages); the runtime does not bind weights here yet. On the GPU machine
one Qwen3-8B block's decode step took the same time with 2.2 GiB of its weights
on huge pages as without (2.66 / 2.77 ms against 2.67 / 2.72 ms, two pairs), so there was no gain to take.
"""
from __future__ import annotations

import mmap

import numpy as np
import tvm.runtime

HUGE_PAGE = 2 << 20
MIN_HUGE_BYTES = 4 * HUGE_PAGE   # smaller tensors gain little and would waste their alignment slack


def huge_page_buffer(nbytes: int, advise: bool = True) -> np.ndarray:
    """Untouched uint8 array of `nbytes`, 2 MiB-aligned, its whole huge pages advised MADV_HUGEPAGE (with
    `advise` False: the same fresh anonymous mapping on 4 KiB pages)."""
    if nbytes <= 0:
        raise ValueError(f"huge_page_buffer: expected a positive size, found {nbytes}")
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(region, dtype=np.uint8)            # holds `region` alive
    start = (-base.ctypes.data) % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if advise and whole and hasattr(region, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        except OSError:   # THP compiled out, or an old kernel: 4 KiB pages, nothing else changes
            pass
    return base[start:start + nbytes]


def cpu_tensor_on_huge_pages(shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
    """An uninitialised CPU tensor in huge_page_buffer memory (dtype "bfloat16": a view of uint16 storage,
    as tvm_tensors does). The tensor owns a reference to the mapping, which is unmapped with the last user."""
    return cpu_tensor_over(huge_page_buffer(tensor_bytes(shape, dtype)), shape, dtype)


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a dense tensor of `shape` and `dtype` (bfloat16: 2)."""
    storage = "uint16" if dtype == "bfloat16" else dtype
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(storage).itemsize


def cpu_tensor_over(region: np.ndarray, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
    """A CPU tensor over the first bytes of `region` (a C-contiguous uint8 array, 64-byte aligned), zero-copy;
    the tensor keeps `region` alive. dtype "bfloat16": a view of uint16 storage, as tvm_tensors does."""
    storage = "uint16" if dtype == "bfloat16" else dtype
    nbytes = tensor_bytes(shape, dtype)
    if region.dtype != np.uint8 or region.nbytes < nbytes or region.ctypes.data % 64:
        raise ValueError(f"cpu_tensor_over: expected a 64-byte-aligned uint8 region of >= {nbytes} bytes, found "
                         f"{region.dtype} of {region.nbytes} bytes at alignment {region.ctypes.data % 64}")
    flat = region[:nbytes].view(storage)                    # [nbytes] uint8 -> [count] storage
    tensor = tvm.runtime.from_dlpack(flat.reshape(shape))   # [count] -> shape, zero-copy
    return tensor._create_view(tuple(shape), dtype) if dtype == "bfloat16" else tensor


def cpu_tensor_from_numpy(arr: np.ndarray, dtype: str) -> tvm.runtime.Tensor:
    """tvm_tensors.tensor_from_numpy on the CPU, in huge-page memory when the tensor is >= MIN_HUGE_BYTES."""
    from helmc.runtime.tvm_tensors import tensor_from_numpy
    if arr.nbytes < MIN_HUGE_BYTES:
        return tensor_from_numpy(arr, dtype, tvm.runtime.cpu())
    if dtype != "bfloat16" and np.dtype(dtype) != arr.dtype:
        raise TypeError(f"cpu_tensor_from_numpy: dtype {dtype!r} expected to match the array's, found {arr.dtype}")
    out = cpu_tensor_on_huge_pages(tuple(arr.shape), dtype)
    storage = "uint16" if dtype == "bfloat16" else dtype
    out._create_view(tuple(arr.shape), storage).copyfrom(np.ascontiguousarray(arr))
    return out


def anon_huge_page_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (/proc/self/smaps_rollup; 0 if unreadable)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
