"""The artifact cache: compiled stage libraries keyed by what they were compiled from.

A key is (model architecture hash, stage, compile target, helmc version, TVM version, sha256 of the
compiler's own sources: the passes and schedules, so an edited kernel is never served stale). The compile
target is the part of the hardware profile the code depends on (CPU features -> LLVM target, CUDA
arch), not the measured bandwidths: re-profiling the same machine must not force a rebuild, while a
profile of another CPU or GPU must. Entries are written to a temporary directory and renamed, so a
killed build never leaves half an entry; each entry records the sha256 of its files, and a lookup that finds
them changed (a disk error, a hand edit) removes the entry and reports a miss, so the stage is rebuilt.
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
        self.corrupt: list[str] = []         # keys whose entries lookup found corrupt and removed

    def lookup(self, key: str) -> str | None:
        """The entry's directory, or None when there is none or it is corrupt (then it is removed)."""
        d = os.path.join(self.root, key)
        if not (self.enabled and os.path.isfile(os.path.join(d, "COMPLETE"))):
            return None
        if self.check(d):
            return d
        self.corrupt.append(key)
        doomed = tempfile.mkdtemp(prefix=f".{key}-corrupt-", dir=self.root)
        try:                                 # rename first: a concurrent lookup never sees half a removal
            os.replace(d, os.path.join(doomed, "entry"))
        except OSError:
            pass
        shutil.rmtree(doomed, ignore_errors=True)
        return None

    def store_tree(self, key: str, src_dir: str, meta: dict) -> str:
        """Copy the directory `src_dir` (subdirectories too) into a new entry; returns the entry directory."""
        files = {}
        for d, _, names in os.walk(src_dir):
            for n in names:
                path = os.path.join(d, n)
                files[os.path.relpath(path, src_dir)] = path
        return self.store(key, files, meta)
    @staticmethod
    def check(entry: str) -> bool:
        """Whether every file the entry's meta.json lists still has the sha256 recorded when it was stored."""
        from helmc.runtime.bundle.manifest import sha256_file
        try:
            with open(os.path.join(entry, "meta.json")) as f:
                recorded = json.load(f).get("sha256")
            if not isinstance(recorded, dict) or not recorded:
                return False                 # an entry from before the hashes: rebuild it once
            return all(sha256_file(os.path.join(entry, name)) == h for name, h in recorded.items())
        except (OSError, ValueError, AttributeError):
            return False

    def store(self, key: str, files: dict[str, str], meta: dict) -> str:
        """Copy `files` (name -> source path) into a new entry; returns the entry directory."""
        os.makedirs(self.root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=self.root)
        try:
            from helmc.runtime.bundle.manifest import sha256_file
            for name, src in files.items():
                os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
                shutil.copy2(src, os.path.join(tmp, name))
            meta = dict(meta, sha256={name: sha256_file(os.path.join(tmp, name)) for name in files})
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
            open(os.path.join(tmp, "COMPLETE"), "w").close()
            final = os.path.join(self.root, key)
            if os.path.exists(final):        # a concurrent build stored the same entry: keep one whole one
                old = tempfile.mkdtemp(prefix=f".{key}-old-", dir=self.root)
                try:
                    os.replace(final, os.path.join(old, "entry"))
                except OSError:
                    pass
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:                  # another build's entry landed in between: same key, same content
                shutil.rmtree(tmp, ignore_errors=True)
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
