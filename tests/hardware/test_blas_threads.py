"""The runtime pins NumPy's BLAS to one thread per call (runtime/tvm_tensors.single_threaded_blas): the CPU
KV cache runs its own attention threads, and a multi-threaded BLAS under them oversubscribed the cores
(8K-context decode 1.15 -> 6.10 tok/s on the 16-core GPU machine when fixed)."""
import ctypes

import numpy as np  # noqa: F401  (loads the BLAS library)
import pytest

from helmc.runtime.tvm_tensors import single_threaded_blas


def _openblas_getters():
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    for path in libs:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(lib, name):
                yield getattr(lib, name)
                break


def test_numpy_blas_runs_single_threaded_after_the_call():
    getters = list(_openblas_getters())
    if not getters:
        pytest.skip("NumPy here is not linked to OpenBLAS")
    assert single_threaded_blas() >= 1
    assert [g() for g in getters] == [1] * len(getters)
