"""GPU tests over kernels built on the compiler machine and carried to the GPU machine: a CUDA device, then the
builder's directory (an environment variable, else a folder under .devrt), else a skip naming the command that
builds it. The library loads with the runtime-only TVM, once per directory."""
from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOADED: dict = {}


def prebuilt_kernels(env: str, subdir: str, what: str, builder: str) -> tuple:
    """(the loaded library, DIR, its manifest) of the kernels `builder` (a tests.device module) wrote, or a skip
    naming what is missing."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:                      # no driver
        pytest.skip(f"no usable CUDA device: {e}")
    d = os.environ.get(env, os.path.join(ROOT, ".devrt", subdir))
    if not os.path.isfile(os.path.join(d, "manifest.json")):
        pytest.skip(f"no {what} at {d}: build them on the compiler machine with "
                    f"`python -m tests.device.{builder} .devrt/{subdir}` and carry .devrt")
    if d not in _LOADED:
        from helmc.runtime.cuda_runtime import load_gpu_executable
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        _LOADED[d] = (load_gpu_executable(os.path.join(d, manifest["library"]),
                                          os.path.join(d, manifest["cubin_index"])), d, manifest)
    return _LOADED[d]
