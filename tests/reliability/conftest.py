"""Fixtures shared by the reliability tests: an empty working directory with the artifact cache and the crash
logs pointed at test directories, the host's hardware.json, and key pairs for signed bundles."""
from __future__ import annotations

import shutil
import subprocess

import pytest


@pytest.fixture
def workdir(tmp_path, monkeypatch, cache_dir):
    """An empty working directory (a command that writes a stray file there is caught); builds use the session's
    artifact cache (never the repository's), crash logs go to tmp_path/logs."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    monkeypatch.setenv("HELMC_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("HELMC_CACHE_DIR", cache_dir)
    monkeypatch.delenv("HELMC_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("HELMC_DEBUG", raising=False)
    return d


@pytest.fixture
def hw_json(tmp_path, host_hardware):
    p = tmp_path / "hw.json"
    host_hardware.save(str(p))
    return p


@pytest.fixture(scope="session")
def keys(tmp_path_factory):
    """owner.key / owner.key.pub (the bundles' signer) and attacker.key / attacker.key.pub, from `helmc keygen`."""
    from cli_check import cli
    d = tmp_path_factory.mktemp("keys")
    for name in ("owner", "attacker"):
        r = cli("keygen", d / f"{name}.key")
        assert r.exit_code == 0, r.output
    return d


@pytest.fixture(scope="session")
def signed_bundle(tiny, cache_dir, host_hardware, keys, tmp_path_factory):
    """The tiny Qwen3 built by `helmc build --sign owner.key` (its stage library from the session's cache)."""
    from cli_check import cli
    tiny.bundle("qwen3")                                  # the compiled stage, in cache_dir
    model, _ = tiny.model("qwen3")
    d = tmp_path_factory.mktemp("signed")
    host_hardware.save(str(d / "hw.json"))
    r = cli("build", model, d / "hw.json", "-o", d / "bundle", "--sign", keys / "owner.key",
            env={"HELMC_CACHE_DIR": cache_dir})
    assert r.exit_code == 0 and "reused cached" in r.output, r.output
    return d / "bundle"


@pytest.fixture(scope="session")
def evil_library(tmp_path_factory):
    """make(marker) -> a shared library whose constructor writes `marker` when the library is loaded."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to make the attacker's library")
    d = tmp_path_factory.mktemp("evil")

    def make(marker) -> str:
        src, lib = d / "evil.c", d / f"evil-{abs(hash(str(marker)))}.so"
        src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run_on_load(void) {\n'
                       f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("constructor ran\\n", f); fclose(f); }}\n}}\n')
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        return str(lib)
    return make


FAULT_SEED = 4242          # the server below fails a request with this seed at its third token


@pytest.fixture(scope="session")
def serve_bundle(tiny, tmp_path_factory, host_hardware, cache_dir):
    """The tiny Qwen3 built for 8 sequences at once with a ChatML template, in a directory named tiny.bundle
    (served as "tiny")."""
    from helmc import api
    from serve_process import CHATML, bundle_with_template
    d = tmp_path_factory.mktemp("serve")
    api.build(tiny.model("qwen3")[0], host_hardware, str(d / "built"), cache_dir=cache_dir, quiet=True, batch=8)
    return bundle_with_template(str(d / "built"), str(d / "tiny.bundle"), CHATML)


@pytest.fixture(scope="session")
def server(serve_bundle, tmp_path_factory):
    """A real `helmc serve` of serve_bundle (8 slots), with the one-sequence fault injected for FAULT_SEED."""
    from serve_process import Server
    s = Server(serve_bundle, tmp_path_factory.mktemp("serve-log") / "serve.log", "--max-batch", "8",
               env={"HELMC_FAULT_SEQUENCE_SEED": str(FAULT_SEED)})
    yield s
    s.stop()
