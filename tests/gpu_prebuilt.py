"""The GPU tests' one preamble: a CUDA device (cuda_device), then what a tests.device builder made on the compiler
machine and carried to the GPU machine (prebuilt_dir: an environment variable, else a folder under .devrt), else a
skip naming what is missing and the command that builds it. prebuilt_kernels loads a builder's kernel library with
the runtime-only TVM, once per directory."""
from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOADED: dict = {}


def cuda_device():
    """CuPy, once it imports and a CUDA device answers; else a skip saying which is missing."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:                      # no driver
        pytest.skip(f"no usable CUDA device: {e}")
    return cp


def prebuilt_dir(env: str, default: str, marker: str, what: str, build: str, needs_gpu: bool = True) -> str:
    """The directory in $`env` (else `default` under .devrt), on a machine with a CUDA device unless not `needs_gpu`,
    once it holds `marker` (a path inside it); else a skip naming what is missing and `build`, the tests.device
    command that makes it."""
    if needs_gpu:
        cuda_device()
    path = os.environ.get(env, os.path.join(ROOT, ".devrt", default))
    if not os.path.isfile(os.path.join(path, marker)):
        pytest.skip(f"no {what} at {path}: build on the compiler machine with `python -m tests.device.{build}` "
                    "and carry .devrt")
    return path


def prebuilt_kernels(env: str, subdir: str, what: str, builder: str) -> tuple:
    """(the loaded library, DIR, its manifest) of the kernels `builder` (a tests.device module) wrote, or a skip
    naming what is missing."""
    d = prebuilt_dir(env, subdir, "manifest.json", what, f"{builder} .devrt/{subdir}")
    if d not in _LOADED:
        from helmc.runtime.cuda_runtime import load_gpu_executable
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        _LOADED[d] = (load_gpu_executable(os.path.join(d, manifest["library"]),
                                          os.path.join(d, manifest["cubin_index"])), d, manifest)
    return _LOADED[d]
