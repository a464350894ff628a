"""Write phase: a self-describing bundle directory, complete or absent.

Everything goes into a temporary directory beside the destination, the manifest (sha256 of every
file) is written last (then its signature, with --sign), and the directory is swapped into place in one
step (Linux renameat2 RENAME_EXCHANGE; elsewhere two renames under the same lock): an existing bundle at
the destination is replaced only after the new one is complete, a build killed at any point leaves the
old bundle or none, and builds into one destination at once serialise their swaps on a lock of the parent
directory, so the result is one whole bundle, the last one swapped in. Temporary directories of killed
builds (named with their process id) are removed by the next build into the same parent.

Fault injection for tests: HELMC_FAULT_BUILD=POINT:kill|raise|pause stops a build at POINT (files_copied,
manifest_written, swapping: just before the swap; swapped: just after it, the previous bundle not yet removed)
with SIGKILL (the process dies there) or an OSError (ENOSPC), or holds it there for a second (so that two builds
meet at that point).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import secrets
import time
from dataclasses import dataclass

from helmc import __version__
from helmc.errors import HelmcError
from helmc.compiler.model_files import TOKENIZER_FILES, copy_text_file, copy_weight_file
from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan
from helmc.runtime.bundle.weights_digest import pin_weights


@dataclass(frozen=True)
class BundleInputs:
    out_dir: str
    spec: ModelSpec
    plan: Plan
    hardware: HardwareProfile
    weights: str                                # a directory of safetensors or a .gguf file
    model_config_sha256: str
    libraries: tuple[tuple[str, str], ...]      # (name in bundle, source path)
    target_hash: str
    cpu_features_required: tuple[str, ...]
    llvm_target: str
    cuda_arch: str
    tvm_version: str
    copy_weights: bool
    prefill_activations: str = ""               # lower_linear.PREFILL_ACTIVATIONS; "" without a CPU stage
    tokenizer_dir: str = ""                     # copy TOKENIZER_FILES from here
    tokenizer_json: str = ""                    # or write this tokenizer.json (read from a GGUF file)
    chat_template: str = ""                     # a GGUF's tokenizer.chat_template, written as chat_template.jinja
    signer: object = None                       # an ed25519 private key: write manifest.sig




FAULT_ENV = "HELMC_FAULT_BUILD"


def fault_point(name: str) -> None:
    """Tests stop a build here (see the module note); a no-op unless HELMC_FAULT_BUILD names this point."""
    point, _, how = os.environ.get(FAULT_ENV, "").partition(":")
    if point != name:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "pause":
        time.sleep(1.0)
        return
    raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")


def write_bundle(b: BundleInputs):
    out = os.path.abspath(b.out_dir)
    try:
        return _write_bundle(b, out)
    except OSError as e:
        raise HelmcError(f"output: could not write the bundle {out}: {e.strerror or e} "
                         f"({e.filename or 'while swapping it in'}); any previous bundle there is unchanged") from None


def _write_bundle(b: BundleInputs, out: str):
    from helmc.runtime.bundle.manifest import BUNDLE_FORMAT_VERSION, MANIFEST_NAME, BundleFile, BundleManifest, sha256_file
    from helmc.jsonio import atomic_write_text

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(out) and not os.path.isfile(os.path.join(out, MANIFEST_NAME)):
        if not os.path.isdir(out) or os.listdir(out):
            raise HelmcError(f"output: {out} exists and is not a helmc bundle; refusing to replace it")
    prefix = f".{os.path.basename(out)}.tmp-"
    with _parent_lock(parent):
        _remove_stale_temporaries(parent, prefix)
    # os.mkdir, not mkdtemp: the bundle gets the umask's mode (mkdtemp's 0700 would hide it from other users)
    tmp = os.path.join(parent, f"{prefix}{os.getpid()}-{secrets.token_hex(6)}")
    os.mkdir(tmp)
    try:
        for name, src in b.libraries:
            shutil.copy2(src, os.path.join(tmp, name))
        fault_point("files_copied")
        for name in TOKENIZER_FILES if b.tokenizer_dir else ():
            if os.path.lexists(os.path.join(b.tokenizer_dir, name)):   # a dangling link too: refused, not skipped
                copy_text_file(b.tokenizer_dir, name, os.path.join(tmp, name))
        if b.tokenizer_json and not b.tokenizer_dir:
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                f.write(b.tokenizer_json)
        if b.chat_template and not os.path.exists(os.path.join(tmp, "chat_template.jinja")):
            with open(os.path.join(tmp, "chat_template.jinja"), "w") as f:
                f.write(b.chat_template)
        for name, text in (("model_spec.json", b.spec.to_json()), ("plan.json", b.plan.to_json()),
                           ("hardware.json", b.hardware.to_json())):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text + "\n")
        weights_dir = os.path.abspath(b.weights)
        if b.copy_weights and os.path.isfile(b.weights):          # one GGUF file
            os.makedirs(os.path.join(tmp, "weights"))
            weights_dir = os.path.join("weights", os.path.basename(b.weights))
            copy_weight_file(os.path.dirname(os.path.abspath(b.weights)), os.path.basename(b.weights),
                             os.path.join(tmp, weights_dir))
        elif b.copy_weights:
            wd = os.path.join(tmp, "weights")
            os.makedirs(wd)
            for name in sorted(os.listdir(b.weights)):
                if name.endswith(".safetensors") or name in ("model.safetensors.index.json", "config.json"):
                    copy_weight_file(b.weights, name, os.path.join(wd, name))
            weights_dir = "weights"
        weights_root = weights_dir if os.path.isabs(weights_dir) else os.path.join(tmp, weights_dir)
        files = []
        for root, _, names in os.walk(tmp):
            for name in sorted(names):
                full = os.path.join(root, name)
                rel = os.path.relpath(full, tmp)
                files.append(BundleFile(rel, sha256_file(full), os.path.getsize(full)))
        manifest = BundleManifest(
            format_version=BUNDLE_FORMAT_VERSION, helmc_version=__version__, tvm_version=b.tvm_version,
            model_arch_hash=b.spec.architecture_hash(), model_config_sha256=b.model_config_sha256,
            hardware_hash=b.hardware.profile_hash(), target_hash=b.target_hash,
            cpu_features_required=b.cpu_features_required, llvm_target=b.llvm_target, cuda_arch=b.cuda_arch,
            weights_dir=weights_dir, files=tuple(sorted(files, key=lambda f: f.path)), created_unix=time.time(),
            prefill_activations=b.prefill_activations, weights=pin_weights(weights_root))
        atomic_write_text(os.path.join(tmp, MANIFEST_NAME), manifest.to_json() + "\n")
        if b.signer is not None:
            from helmc.runtime.bundle.signature import sign_manifest
            sign_manifest(os.path.join(tmp, MANIFEST_NAME), b.signer)
        fault_point("manifest_written")
        with _parent_lock(parent):
            if os.path.exists(out) and not os.path.isfile(os.path.join(out, MANIFEST_NAME)) and os.listdir(out):
                raise HelmcError(f"output: {out} exists and is not a helmc bundle; refusing to replace it")
            _swap_in(tmp, out)
        fault_point("swapped")
        shutil.rmtree(tmp, ignore_errors=True)         # the previous bundle, if there was one
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _parent_lock:
    """An exclusive flock on the directory itself (no lock file left behind); released when the process dies."""

    def __init__(self, parent: str):
        self.parent = parent

    def __enter__(self):
        self.fd = os.open(self.parent, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _remove_stale_temporaries(parent: str, prefix: str) -> None:
    """Temporary directories that builds killed before their swap left beside the destination."""
    for name in os.listdir(parent):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _swap_in(tmp: str, out: str) -> None:
    """Put the complete bundle `tmp` at `out`; afterwards `tmp` holds the previous bundle (or is empty)."""
    if not os.path.exists(out):
        fault_point("swapping")
        os.replace(tmp, out)
        return
    fault_point("swapping")
    if _exchange(tmp, out):
        return
    # No atomic exchange: move the old bundle aside, the new one in, and the old one back if that fails.
    aside = tmp + ".old"
    os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside, out)
        raise
    os.replace(aside, tmp)
