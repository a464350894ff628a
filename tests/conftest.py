"""Shared fixtures: tiny random-weight models in real architectures and their bundles.

Builds are the slow part of the suite (ONNX export + LLVM compile, ~20 s each on 2 cores), so each
(architecture, dtype) is built once per session and shared; the artifact cache lives in a
per-session temporary directory so the tests exercise real compiles.
"""
from __future__ import annotations

import os
import re

import pytest

ARCHS = ("qwen3", "qwen2", "llama", "mistral")

# The GPU test machine has a runtime-only TVM (TVM_USE_RUNTIME_LIB=1: tvm.runtime imports, tvm.relax
# and the TIR/TensorIR modules do not). A test module that imports the compiler at import time is
# skipped there as a whole, with the reason, instead of stopping collection for every GPU test.
_COMPILER_IN_TRACEBACK = re.compile(r"tvm[/\\.](relax|tirx?|s_tir|script|te|topi|dlight|meta_schedule|driver)\b")
_compiler_ok: list[bool] = []


def compiler_available() -> bool:
    """Whether this TVM has its compiler (tvm.relax imports); checked once, on first need."""
    if not _compiler_ok:
        try:
            import tvm.relax  # noqa: F401
            _compiler_ok.append(True)
        except Exception:
            _compiler_ok.append(False)
    return _compiler_ok[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.failed and isinstance(collector, pytest.Module)):
        return
    text = str(rep.longrepr)
    if _COMPILER_IN_TRACEBACK.search(text) and not compiler_available():
        last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
        rep.outcome = "skipped"
        rep.longrepr = (str(collector.path), 0, "Skipped: imports the TVM compiler, which this runtime-only TVM "
                        f"lacks ({last[0].strip()[:160]})")
        rep.result = []


@pytest.fixture(scope="session")
def host_hardware():
    # Quick sizes, no per-block overheads: a compile target and rough rates for the tests' tiny builds. The
    # profile kit it measures with is cached in the artifact cache, so later sessions compile nothing.
    from helmc.api import profile
    return profile(quick=True, overheads=False, progress=lambda m: None)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("artifact-cache"))


class TinyModels:
    """Lazily makes model directories and bundles, once per key."""

    def __init__(self, root, hardware, cache_dir):
        self.root, self.hardware, self.cache_dir = root, hardware, cache_dir
        self._models, self._bundles = {}, {}

    def model(self, arch: str, dtype: str = "float32", **kw):
        key = (arch, dtype, tuple(sorted(kw.items())))
        if key not in self._models:
            from helmc.testing import make_tiny_model
            d = os.path.join(self.root, "-".join(map(str, (arch, dtype) + tuple(f"{k}{v}" for k, v in sorted(kw.items())))))
            ref = make_tiny_model(d, arch, dtype=dtype, **kw)
            self._models[key] = (d, ref.float().eval())
        return self._models[key]

    def bundle(self, arch: str, dtype: str = "float32", **kw):
        key = (arch, dtype, tuple(sorted(kw.items())))
        if key not in self._bundles:
            from helmc import api
            d, _ = self.model(arch, dtype, **kw)
            out = d + ".bundle"
            api.build(d, self.hardware, out, cache_dir=self.cache_dir, quiet=True)
            self._bundles[key] = out
        return self._bundles[key]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, host_hardware, cache_dir):
    return TinyModels(str(tmp_path_factory.mktemp("tiny-models")), host_hardware, cache_dir)
