"""Shared fixtures: tiny random-weight models in real architectures and their bundles.

Builds are the slow part of the suite (ONNX export + LLVM compile, ~20 s each on 2 cores), so each
(architecture, dtype) is built once per session and shared; the artifact cache lives in a
per-session temporary directory so the tests exercise real compiles.
"""
from __future__ import annotations

import os

import pytest

ARCHS = ("qwen3", "qwen2", "llama", "mistral")


@pytest.fixture(scope="session")
def host_hardware():
    from helmc.profile_hardware import profile
    return profile(quick=True)


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
