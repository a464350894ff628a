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
from helmc.jsonio import from_dict, load_json_file, to_dict

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

    def file(self, path: str) -> BundleFile:
        for f in self.files:
            if f.path == path:
                return f
        raise HelmcError(f"bundle manifest: no file {path!r} listed")

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BundleManifest":
        return from_dict(cls, json.loads(text), "bundle manifest")


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


def verify_bundle(bundle_dir: str, cpu_flags: frozenset[str] | None = None) -> BundleManifest:
    """Every check that must pass before a library of the bundle is loaded."""
    if not os.path.isdir(bundle_dir):
        raise HelmcError(f"bundle: expected a directory, found nothing at {bundle_dir}")
    raw = load_json_file(os.path.join(bundle_dir, MANIFEST_NAME), "bundle manifest")
    if not isinstance(raw, dict) or raw.get("format_version") != BUNDLE_FORMAT_VERSION:
        found = raw.get("format_version") if isinstance(raw, dict) else type(raw).__name__
        raise HelmcError(f"bundle manifest: format_version expected {BUNDLE_FORMAT_VERSION}, found {found}")
    manifest = from_dict(BundleManifest, raw, "bundle manifest")
    listed = set()
    for f in manifest.files:
        if os.path.isabs(f.path) or ".." in f.path.split("/"):
            raise HelmcError(f"bundle manifest: file path must stay inside the bundle, found {f.path!r}")
        full = os.path.join(bundle_dir, f.path)
        if not os.path.isfile(full):
            raise HelmcError(f"bundle: {f.path} listed in the manifest is missing")
        actual = sha256_file(full)
        if actual != f.sha256:
            raise HelmcError(f"bundle: {f.path} sha256 expected {f.sha256[:16]}..., found {actual[:16]}... (modified or corrupt; rebuild the bundle)")
        listed.add(f.path)
    for name in os.listdir(bundle_dir):
        if name.endswith((".so", ".cubin", ".json")) and name not in listed and name != MANIFEST_NAME:
            raise HelmcError(f"bundle: {name} is not listed in the manifest; refusing a bundle with unlisted code or data")
    flags = host_cpu_flags() if cpu_flags is None else cpu_flags
    missing = [f for f in manifest.cpu_features_required if f not in flags]
    if missing:
        raise HelmcError(f"bundle: built for CPU features {list(manifest.cpu_features_required)}; this CPU lacks {missing} "
                         f"(rebuild with a hardware profile of this machine)")
    return manifest
