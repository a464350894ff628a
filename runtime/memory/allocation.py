"""One entry for the runtime's large allocations, so that running out of memory is a HelmcError, not a traceback.

Weights (a tensor per checkpoint tensor on its device), KV caches (the CPU arena, the GPU page store) and
pinned host memory (KV extents, prefill arenas, upload staging) are allocated through `allocate(site, nbytes,
make)`. A failure to allocate (MemoryError, CuPy's OutOfMemoryError, a CUDA or TVM allocation error) becomes
a HelmcError that says what was being allocated and how much, raised outside the handler so it holds no
reference to the failing frames; Session.load then drops its own traceback, so whatever was allocated before
the failure is freed as the error leaves (runtime/session.py).

Fault injection, for tests: HELMC_FAULT_ALLOC=SITE[:N] makes the Nth allocation at SITE (weights, kv or
pinned; N counted from the first allocation at SITE after the variable took this value; default 1) raise
MemoryError before allocating anything. `observers` are called with (site, nbytes, object) after each
allocation, so a test can check that a failed load leaves nothing held.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

import numpy as np

from helmc.errors import HelmcError

T = TypeVar("T")
SITES = {"weights": "model weights", "kv": "the KV cache", "pinned": "pinned (page-locked) host memory"}
FAULT_ENV = "HELMC_FAULT_ALLOC"
observers: list[Callable[[str, int, object], None]] = []
_counted: dict[str, tuple[str, int]] = {}        # site -> (HELMC_FAULT_ALLOC value counted under, allocations)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


def reset_fault_counts() -> None:
    """Start counting HELMC_FAULT_ALLOC's N afresh (tests that set the same value twice)."""
    _counted.clear()


def _inject(site: str) -> None:
    value = os.environ.get(FAULT_ENV, "")
    target, _, nth = value.partition(":")
    if target != site:
        _counted.pop(site, None)          # unset or aimed elsewhere: the next time it names this site counts from 1
        return
    seen_under, count = _counted.get(site, ("", 0))
    count = (count if seen_under == value else 0) + 1
    _counted[site] = (value, count)
    if count == (int(nth) if nth.isdigit() else 1):
        raise MemoryError(f"injected by {FAULT_ENV}={value}")


def _is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "memoryallocation" in text
                                            or "failed to allocate" in text)


def allocate(site: str, nbytes: int, make: Callable[[], T], what: str = "") -> T:
    """make() (which allocates about `nbytes` for `site`), or a HelmcError if the memory is not there."""
    assert site in SITES, site
    failure = ""
    try:
        _inject(site)
        obj = make()
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        failure = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    if failure:          # raised here, outside the handler: the error keeps no frame that held memory alive
        raise HelmcError(f"memory: expected {_size(nbytes)} free for {SITES[site]}{' (' + what + ')' if what else ''}, "
                         f"the allocation failed ({failure}); free memory, or build for less (a smaller "
                         "--gpu-budget, --prompt-len / --output-len)")
    for observe in observers:
        observe(site, nbytes, obj)
    return obj


def aligned_empty(shape: tuple[int, ...], dtype, zero: bool = False) -> np.ndarray:
    """np.empty (np.zeros with zero=True) whose data starts on a 64-byte boundary: what cpu_tensor_view and
    tvm.runtime.from_dlpack take without a copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)
