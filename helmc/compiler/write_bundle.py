"""Write phase: a self-describing bundle directory, complete or absent.

Everything goes into a temporary directory beside the destination, the manifest (sha256 of every
file) is written last, and the directory is renamed into place; an existing bundle at the
destination is replaced only after the new one is complete.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from helmc import __version__
from helmc.errors import HelmcError
from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def write_bundle(b: BundleInputs):
    from helmc.runtime.bundle.manifest import BUNDLE_FORMAT_VERSION, MANIFEST_NAME, BundleFile, BundleManifest, sha256_file
    from helmc.jsonio import atomic_write_text

    out = os.path.abspath(b.out_dir)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(out) and not os.path.isfile(os.path.join(out, MANIFEST_NAME)):
        if os.listdir(out):
            raise HelmcError(f"output: {out} exists and is not a helmc bundle; refusing to replace it")
    tmp = tempfile.mkdtemp(prefix=".bundle-", dir=parent)
    try:
        for name, src in b.libraries:
            shutil.copy2(src, os.path.join(tmp, name))
        for name in TOKENIZER_FILES if b.tokenizer_dir else ():
            src = os.path.join(b.tokenizer_dir, name)
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(tmp, name))
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
            shutil.copy2(b.weights, os.path.join(tmp, weights_dir))
        elif b.copy_weights:
            wd = os.path.join(tmp, "weights")
            os.makedirs(wd)
            for name in sorted(os.listdir(b.weights)):
                if name.endswith(".safetensors") or name in ("model.safetensors.index.json", "config.json"):
                    shutil.copy2(os.path.join(b.weights, name), os.path.join(wd, name))
            weights_dir = "weights"
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
            prefill_activations=b.prefill_activations)
        atomic_write_text(os.path.join(tmp, MANIFEST_NAME), manifest.to_json() + "\n")
        old = None
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=".old-bundle-", dir=parent)
            os.replace(out, os.path.join(old, "b"))
        os.replace(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
