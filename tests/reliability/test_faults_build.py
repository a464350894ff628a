"""Faults during `helmc build`, and what they leave on disk.

- A build killed (SIGKILL, in its own process) at each step of writing the bundle leaves no bundle, or the old
  one byte for byte; at most a temporary directory named for the dead process, which the next build into the
  same place removes; that next build works.
- Two builds into one directory at once (held together at the swap) give one whole bundle, never a mix.
- A build that fails (disk full injected, or a bad model) into an existing good bundle keeps it.
- A corrupted artifact-cache entry is found (sha256 of its files), removed and rebuilt.
Each test prints what it left.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cli_check import cli, refused, tree

HELMC = [sys.executable, "-m", "helmc.cli.main"]
# The plan of another batch that a build here writes: the served bundles' (serve_bundle in conftest.py,
# tests/serve), so its compiled stage is one entry of the session's artifact cache for all of them.
BATCH = 8


def _env(cache_dir, **extra) -> dict:
    return dict(os.environ, HELMC_CACHE_DIR=cache_dir, **extra)


def _build_args(tiny, hw_json, out, *more):
    return ["build", str(tiny.model("qwen3")[0]), str(hw_json), "-o", str(out), *map(str, more)]


def _verify(bundle):
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.runtime.bundle.plan import Plan
    verify_bundle(str(bundle))
    return Plan.from_json((bundle / "plan.json").read_text())


def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "over_a_bundle"])
@pytest.mark.parametrize("point", ["files_copied", "manifest_written", "swapping", "swapped"])
def test_build_killed_half_way(point, existing, tiny, hw_json, cache_dir, tmp_path, workdir):
    parent = tmp_path / "out"
    parent.mkdir()
    out = parent / "bundle"
    if existing:
        shutil.copytree(tiny.bundle("qwen3"), out)
    before = tree(out)
    p = subprocess.run(HELMC + _build_args(tiny, hw_json, out, "--max-batch", BATCH), capture_output=True, text=True,
                       env=_env(cache_dir, HELMC_FAULT_BUILD=f"{point}:kill"), timeout=300)
    assert p.returncode == -9, p.stderr
    left = _listing(parent)
    print(f"killed at {point} ({'over a bundle' if existing else 'fresh'}): left {left}")
    stale = [n for n in left if n.startswith(".bundle.tmp-")]
    assert len(stale) <= 1
    if point == "swapped":                       # the new bundle is in, the old one (if any) awaits removal
        assert _verify(out).workload.batch == BATCH
        assert len(stale) == existing
    elif existing:
        assert tree(out) == before               # the old bundle, byte for byte
    else:
        assert not out.exists()
    r = cli(*_build_args(tiny, hw_json, out))
    assert r.exit_code == 0, r.output
    assert _listing(parent) == ["bundle"]        # the dead build's temporary directory is gone
    assert _verify(out).workload.batch == 1


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "over_a_bundle"])
def test_two_builds_into_one_directory(existing, tiny, hw_json, cache_dir, tmp_path, workdir):
    """Builds of different plans (--max-batch 1 and BATCH), held together just before their swaps: the result
    verifies (every file matches the one manifest) and its plan is one of the two, whole."""
    parent = tmp_path / "out"
    parent.mkdir()
    out = parent / "bundle"
    if existing:
        shutil.copytree(tiny.bundle("qwen3"), out)
    env = _env(cache_dir, HELMC_FAULT_BUILD="manifest_written:pause")
    procs = [subprocess.Popen(HELMC + _build_args(tiny, hw_json, out, "--max-batch", n), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (1, BATCH)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    batch = _verify(out).workload.batch
    print(f"two builds (batch 1 and {BATCH}) into one directory: the bundle has batch {batch}; left {_listing(parent)}")
    assert batch in (1, BATCH)
    assert _listing(parent) == ["bundle"]


@pytest.mark.parametrize("point", ["files_copied", "manifest_written", "swapping"])
def test_failing_build_keeps_the_old_bundle(point, tiny, hw_json, tmp_path, workdir, monkeypatch):
    out = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), out)
    before = tree(tmp_path)
    monkeypatch.setenv("HELMC_FAULT_BUILD", f"{point}:raise")
    refused(cli(*_build_args(tiny, hw_json, out, "--max-batch", BATCH)), "No space left on device",
            "any previous bundle there is unchanged")
    assert tree(tmp_path) == before
    assert _verify(out).workload.batch == 1


def test_bad_model_into_an_existing_bundle_keeps_it(tiny, hw_json, tmp_path, workdir):
    model = tmp_path / "model"
    shutil.copytree(tiny.model("qwen3")[0], model)
    (model / "config.json").write_text("{}")
    out = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), out)
    before = tree(tmp_path)
    refused(cli("build", model, hw_json, "-o", out), "config.json")
    assert tree(tmp_path) == before


def test_output_that_is_not_a_bundle_is_never_replaced(tiny, hw_json, tmp_path, workdir):
    out = tmp_path / "my-documents"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    before = tree(tmp_path)
    refused(cli(*_build_args(tiny, hw_json, out)), "exists and is not a helmc bundle")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("damage", ["library_flipped", "library_deleted", "meta_not_json"])
def test_corrupted_cache_entry_is_detected_and_rebuilt(damage, tiny, hw_json, tmp_path, workdir, monkeypatch):
    """The session's cached CPU stage, copied and damaged: the build says so, compiles it again, stores a whole
    entry, and the bundle gives the tokens the undamaged one gives."""
    from helmc.compiler.artifact_cache import ArtifactCache
    from helmc.runtime.session import Session
    tiny.bundle("qwen3")
    cache = tmp_path / "cache"
    shutil.copytree(tiny.cache_dir, cache)
    monkeypatch.setenv("HELMC_CACHE_DIR", str(cache))
    entries = [d for d in _listing(cache) if os.path.isfile(cache / d / "cpu_stage.so")]
    assert entries
    for d in entries:
        lib, meta = cache / d / "cpu_stage.so", cache / d / "meta.json"
        if damage == "library_flipped":
            data = bytearray(lib.read_bytes())
            data[len(data) // 2] ^= 0xFF
            lib.write_bytes(bytes(data))
        elif damage == "library_deleted":
            lib.unlink()
        else:
            meta.write_text("{")
    assert not any(ArtifactCache.check(str(cache / d)) for d in entries)
    r = cli(*_build_args(tiny, hw_json, tmp_path / "bundle"))
    assert r.exit_code == 0, r.output
    assert "reused cached" not in r.output
    assert "corrupt (a file missing or changed since it was stored); removed, rebuilding" in r.stderr, r.stderr
    print(f"{damage}: {[line for line in r.stderr.splitlines() if 'compile_cpu' in line]}")
    again = cli(*_build_args(tiny, hw_json, tmp_path / "bundle2"))
    assert "reused cached: cpu" in again.output, again.output
    want = Session.load(tiny.bundle("qwen3")).generate(prompt_ids=[1, 2, 3], max_new_tokens=4).tokens
    assert Session.load(str(tmp_path / "bundle")).generate(prompt_ids=[1, 2, 3], max_new_tokens=4).tokens == want


def test_bundle_is_readable_as_the_umask_allows(tiny, hw_json, tmp_path, workdir):
    """The temporary directory and files a bundle is written through keep the umask's modes (not mkdtemp's 0700 or
    mkstemp's 0600): a bundle on a shared drive is readable by the others who run it."""
    import stat
    old = os.umask(0o022)
    try:
        r = cli(*_build_args(tiny, hw_json, tmp_path / "bundle"))
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    b = tmp_path / "bundle"
    assert stat.S_IMODE(os.stat(b).st_mode) == 0o755
    modes = {n: stat.S_IMODE(os.stat(b / n).st_mode) for n in _listing(b)}
    assert all(m & 0o044 == 0o044 for m in modes.values()), modes
