"""BundleManifest and the checks `helmc run` makes before any library in a bundle is loaded.

Loading a shared library runs its code, so a bundle is verified first: the format version, the
sha256 of every listed file (and that nothing unlisted poses as a stage library), and that this
CPU has every instruction-set feature the compiled code was built for.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.jsonio import from_dict, parse_json, to_dict
from helmc.runtime.bundle.weights_digest import WeightFile

BUNDLE_FORMAT_VERSION = 5              # 2: paged attention prebuilt; 3: step read from device memory; 4: splits in tokens;
                                       # 5: batched decode variants (decode_b{B}) for plans of batch > 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class BundleFile:
    path: str          # relative to the bundle directory
    sha256: str
    size: int


@dataclass(frozen=True)
class BundleManifest:
    format_version: int
    helmc_version: str
    tvm_version: str
    model_arch_hash: str
    model_config_sha256: str
    hardware_hash: str
    target_hash: str                       # the part of the profile the compiled code depends on
    cpu_features_required: tuple[str, ...]
    llvm_target: str
    cuda_arch: str                         # "" when the plan has no GPU stage
    weights_dir: str                       # absolute, or relative to the bundle when copied in
    files: tuple[BundleFile, ...]
    created_unix: float = 0.0
    # Precision of the CPU stage's AMX prefill activations (helmc build --prefill-activations): "model" or
    # "fp32"; "" without a CPU stage, and in bundles written before the option (which were "model").
    prefill_activations: str = ""
    # Each weight file's size and digest (weights_digest.py), beside the bundle or copied in: a signed manifest pins
    # the weights too, and --require-signed checks them before binding. Empty in bundles written before.
    weights: tuple[WeightFile, ...] = ()

    def file(self, path: str) -> BundleFile:
        for f in self.files:
            if f.path == path:
                return f
        raise HelmcError(f"bundle manifest: no file {path!r} listed")

    def lists(self, path: str) -> bool:
        return any(f.path == path for f in self.files)

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BundleManifest":
        return from_dict(cls, parse_json(text, "bundle manifest"), "bundle manifest")


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def host_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_bundle_dir(path: str) -> bool:
    """A directory `helmc build` wrote (its manifest and plan), as opposed to a model directory or file."""
    return os.path.isdir(path) and all(os.path.isfile(os.path.join(path, f)) for f in (MANIFEST_NAME, "plan.json"))


def verify_bundle(bundle_dir: str, cpu_flags: frozenset[str] | None = None, trusted_keys: tuple | None = None,
                  require_signed: bool = False) -> BundleManifest:
    """Every check that must pass before a library of the bundle is loaded. The signature comes first
    (signature.verify_manifest_signature: over the manifest's bytes as read here, before any other file of the
    bundle is opened); then the manifest's own checks, each listed file (inside the bundle, a regular file, its
    size and sha256), nothing unlisted, and this CPU's features. trusted_keys: signature.PublicKey tuple, or
    None for those HELMC_TRUSTED_KEYS names (signature.trusted_keys)."""
    from helmc.runtime.bundle.signature import SIGNATURE_NAME, trusted_keys as env_keys, verify_manifest_signature
    if trusted_keys is None:          # no keys given: those HELMC_TRUSTED_KEYS names, so every loader honours it
        trusted_keys = env_keys()
    _refuse_a_model(bundle_dir)
    if not os.path.isdir(bundle_dir):
        raise HelmcError(f"bundle: expected a directory, found {'a file' if os.path.exists(bundle_dir) else 'nothing'} "
                         f"at {bundle_dir}")
    manifest_bytes = _read_manifest_bytes(bundle_dir)
    verify_manifest_signature(bundle_dir, manifest_bytes, tuple(trusted_keys), require_signed)
    try:
        raw = json.loads(manifest_bytes)
    except (ValueError, RecursionError) as e:
        raise HelmcError(f"bundle manifest: {os.path.join(bundle_dir, MANIFEST_NAME)} is not valid JSON "
                         f"({getattr(e, 'msg', type(e).__name__)})") from None
    if not isinstance(raw, dict) or raw.get("format_version") != BUNDLE_FORMAT_VERSION:
        found = raw.get("format_version") if isinstance(raw, dict) else type(raw).__name__
        raise HelmcError(f"bundle manifest: format_version expected {BUNDLE_FORMAT_VERSION}, found {found}")
    manifest = from_dict(BundleManifest, raw, "bundle manifest")
    root = os.path.realpath(bundle_dir)
    listed = set()
    for f in manifest.files:
        full = _listed_file(bundle_dir, root, f)
        if os.path.getsize(full) != f.size:
            raise HelmcError(f"bundle: {f.path} size expected {f.size} bytes, found {os.path.getsize(full)} "
                             "(modified or corrupt; rebuild the bundle)")
        actual = sha256_file(full)
        if actual != f.sha256:
            raise HelmcError(f"bundle: {f.path} sha256 expected {f.sha256[:16]}..., found {actual[:16]}... (modified or corrupt; rebuild the bundle)")
        listed.add(f.path)
    for d, dirs, names in os.walk(bundle_dir):
        for name in sorted(names + [x for x in dirs if os.path.islink(os.path.join(d, x))]):
            rel = os.path.relpath(os.path.join(d, name), bundle_dir).replace(os.sep, "/")
            if rel not in listed and rel not in (MANIFEST_NAME, SIGNATURE_NAME):
                raise HelmcError(f"bundle: {rel} is not listed in the manifest; refusing a bundle with unlisted code or data")
    flags = host_cpu_flags() if cpu_flags is None else cpu_flags
    missing = [f for f in manifest.cpu_features_required if f not in flags]
    if missing:
        raise HelmcError(f"bundle: built for CPU features {list(manifest.cpu_features_required)}; this CPU lacks {missing} "
                         f"(rebuild with a hardware profile of this machine)")
    return manifest


_MAX_MANIFEST_BYTES = 64 << 20


def _refuse_a_model(path: str) -> None:
    """A model given where a bundle belongs (the commonest slip of a first run): name what it is and the build that
    makes a bundle of it."""
    kind = None
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                kind = "a GGUF file" if f.read(4) == b"GGUF" else None
        except OSError:
            pass
    elif os.path.isdir(path) and not os.path.lexists(os.path.join(path, MANIFEST_NAME)) \
            and os.path.isfile(os.path.join(path, "config.json")):
        kind = "a Hugging Face model directory"
    if kind:
        out = os.path.splitext(os.path.basename(os.path.normpath(path)))[0] + ".bundle"
        raise HelmcError(f"bundle: expected a bundle directory (made by helmc build), found {kind} at {path}; compile "
                         f"it first: helmc build {path} hardware.json -o {out}")


def _read_manifest_bytes(bundle_dir: str) -> bytes:
    path = os.path.join(bundle_dir, MANIFEST_NAME)
    if os.path.islink(path) or not os.path.isfile(path):
        raise HelmcError(f"bundle manifest: expected a regular file {path}, found "
                         f"{'a link' if os.path.islink(path) else 'nothing' if not os.path.exists(path) else 'a directory'}")
    with open(path, "rb") as f:
        data = f.read(_MAX_MANIFEST_BYTES + 1)
    if len(data) > _MAX_MANIFEST_BYTES:
        raise HelmcError(f"bundle manifest: expected at most {_MAX_MANIFEST_BYTES} bytes, found a larger {path}")
    return data


def _listed_file(bundle_dir: str, root: str, f: BundleFile) -> str:
    """The path of a listed file after checking that it names a regular file inside the bundle: no absolute
    path, no `..`, no symbolic link anywhere on the way (a link could point at any file on the machine)."""
    parts = f.path.split("/")
    if not f.path or os.path.isabs(f.path) or "\\" in f.path or any(p in ("", ".", "..") for p in parts):
        raise HelmcError(f"bundle manifest: file path must stay inside the bundle, found {f.path!r}")
    full = os.path.join(bundle_dir, *parts)
    for i in range(1, len(parts) + 1):
        if os.path.islink(os.path.join(bundle_dir, *parts[:i])):
            raise HelmcError(f"bundle: {f.path} is a symbolic link ({'/'.join(parts[:i])} -> "
                             f"{os.readlink(os.path.join(bundle_dir, *parts[:i]))}); expected a regular file in the bundle")
    if not os.path.isfile(full):
        raise HelmcError(f"bundle: {f.path} listed in the manifest is missing")
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise HelmcError(f"bundle manifest: file path must stay inside the bundle, found {f.path!r}")
    return full
