"""The artifact cache: compiled stage libraries keyed by what they were compiled from.

A key is (model architecture hash, stage, compile target, helmc version, TVM version, sha256 of the
compiler's own sources: the passes and schedules, so an edited kernel is never served stale). The compile
target is the part of the hardware profile the code depends on (CPU features -> LLVM target, CUDA
arch), not the measured bandwidths: re-profiling the same machine must not force a rebuild, while a
profile of another CPU or GPU must. Entries are written to a temporary directory and renamed, so a
killed build never leaves half an entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from helmc import __version__


def default_cache_dir() -> str:
    env = os.environ.get("HELMC_CACHE_DIR")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isdir(os.path.join(root, "artifacts")):
        return os.path.join(root, "artifacts", "cache")
    return os.path.join(os.path.expanduser("~"), ".cache", "helmc")


def tvm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("apache-tvm")
    except PackageNotFoundError:
        import tvm
        return tvm.__version__


# What a compiled stage depends on besides the schedules: every compiler pass, the model readers, and the
# program analysis the stages are cut by.
_COMPILER_SOURCE_DIRS = ("compiler", os.path.join("compiler", "passes"), "model")
_COMPILER_SOURCE_FILES = (os.path.join("planner", "analyze_program.py"),)


def compiler_sources_hash() -> str:
    """sha256 over the compiler passes and model readers in helmc/ and every schedule in helmc.schedules."""
    import glob

    from helmc import schedules
    helmc_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [os.path.join(helmc_dir, n) for n in _COMPILER_SOURCE_FILES]
    for d in _COMPILER_SOURCE_DIRS:
        files += glob.glob(os.path.join(helmc_dir, d, "*.py"))
    for d in schedules.__path__:
        files += glob.glob(os.path.join(d, "**", "*.py"), recursive=True)
    h = hashlib.sha256()
    for path in sorted(set(files)):
        h.update(os.path.relpath(path, helmc_dir).encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def cache_key(model_arch_hash: str, stage: str, target: str) -> str:
    payload = json.dumps({"model": model_arch_hash, "stage": stage, "target": target,
                          "helmc": __version__, "tvm": tvm_version(), "sources": compiler_sources_hash()},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


class ArtifactCache:
    def __init__(self, root: str | None = None, enabled: bool = True):
        self.root = root or default_cache_dir()
        self.enabled = enabled

    def lookup(self, key: str) -> str | None:
        d = os.path.join(self.root, key)
        if self.enabled and os.path.isfile(os.path.join(d, "COMPLETE")):
            return d
        return None

    def store_tree(self, key: str, src_dir: str, meta: dict) -> str:
        """Copy the directory `src_dir` (subdirectories too) into a new entry; returns the entry directory."""
        files = {}
        for d, _, names in os.walk(src_dir):
            for n in names:
                path = os.path.join(d, n)
                files[os.path.relpath(path, src_dir)] = path
        return self.store(key, files, meta)

    def store(self, key: str, files: dict[str, str], meta: dict) -> str:
        """Copy `files` (name -> source path) into a new entry; returns the entry directory."""
        os.makedirs(self.root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=self.root)
        try:
            for name, src in files.items():
                os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
                shutil.copy2(src, os.path.join(tmp, name))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
            open(os.path.join(tmp, "COMPLETE"), "w").close()
            final = os.path.join(self.root, key)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
