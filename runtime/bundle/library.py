"""Loading a bundle's shared libraries from the very bytes that were verified.

verify_bundle hashes every file before any library loads; loading a library by its path afterwards would load
whatever the path holds by then, and a file swapped in between (a writable bundle directory, a shared
volume) would run its code unverified. So a library is read once into memory, its sha256 checked against the
verified manifest, and the loader is handed those bytes in an anonymous in-memory file (memfd, close-on-exec,
under a name of its own in a private 0700 directory; a plain copy there where there is no memfd), never the
bundle's path.

    with verified_library(bundle_dir, manifest, "cpu_stage.so") as path:   # /tmp/helmc-lib-XXXX/cpu_stage.so
        module = load_library(path)
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile

from helmc.errors import HelmcError
from helmc.runtime.bundle.manifest import BundleManifest


@contextlib.contextmanager
def verified_library(bundle_dir: str, manifest: BundleManifest, name: str):
    """A path to a private copy of the bundle's file `name` whose bytes have the verified manifest's sha256, for
    the length of the with block (a loader maps it, so it may go afterwards)."""
    entry = manifest.file(name)
    try:
        with open(os.path.join(bundle_dir, name), "rb") as f:
            data = f.read(entry.size + 1)
    except OSError as e:
        raise HelmcError(f"bundle: {name} could not be read after it was verified ({e.strerror})") from None
    found = hashlib.sha256(data).hexdigest()
    if found != entry.sha256:
        raise HelmcError(f"bundle: {name} changed after it was verified (sha256 expected {entry.sha256[:16]}..., "
                         f"found {found[:16]}...); refusing to load it")
    # A name of its own for every load: the dynamic loader hands back an already loaded library whose name
    # matches (a reused /proc/self/fd/N would return the previous library). The bytes live in a memfd (a
    # /tmp mounted noexec could not map them), reached through a link in a private 0700 directory.
    d = tempfile.mkdtemp(prefix="helmc-lib-")
    fd = None
    try:
        path = os.path.join(d, os.path.basename(name))
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(os.path.basename(name), os.MFD_CLOEXEC)
            _write_all(fd, data)
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)
        else:
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o500)
            try:
                _write_all(out, data)
            finally:
                os.close(out)
        yield path
    finally:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def load_library(path: str):
    """A TVM module from the shared library at `path`, whatever its name (tvm.runtime.load_module picks the loader
    by the file's extension and resolves links first); kept alive for the process, as load_module keeps it."""
    import tvm_ffi
    module = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")(path, "so")
    tvm_ffi.get_global_func("ffi.ModuleGlobalsAdd")(module)
    return module
