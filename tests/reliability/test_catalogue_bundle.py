"""Catalogue of damaged bundles, through `helmc run`: every file with a byte flipped, every file deleted, files
added, manifest paths with `..` or absolute, symbolic links out of the bundle, a foreign CPU. Each is refused in
one line, exit status 2, before any library is loaded, and the bundle is left as it was (nothing written)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from cli_check import cli, refused, tree

RUN = ("--prompt-ids", "1,2,3", "--max-new-tokens", "2")
# Every file of the tiny Qwen3's bundle (test_the_list_is_every_file keeps this true).
FILES = ("cpu_stage.so", "generation_config.json", "hardware.json", "manifest.json", "model_spec.json", "plan.json",
         "tokenizer.json")


@pytest.fixture
def bundle(tiny, tmp_path):
    b = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), b)
    return b


def _manifest(b, edit):
    m = json.loads((b / "manifest.json").read_text())
    edit(m)
    (b / "manifest.json").write_text(json.dumps(m, indent=2))


def _entry(m, path):
    return next(f for f in m["files"] if f["path"] == path)


def test_the_list_is_every_file(tiny):
    assert tuple(sorted(os.listdir(tiny.bundle("qwen3")))) == FILES


def _refused_untouched(b, tmp_path, *fragments, args=RUN, trust=()):
    before = tree(tmp_path)
    line = refused(cli("run", b, *args, *trust), *fragments)
    assert tree(tmp_path) == before
    return line


@pytest.mark.parametrize("name", FILES)
def test_file_flipped(name, bundle, tmp_path, workdir):
    p = bundle / name
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    _refused_untouched(bundle, tmp_path, "bundle" if name == "manifest.json" else f"bundle: {name} sha256 expected")


@pytest.mark.parametrize("name", FILES + ("manifest.sig",))
def test_signed_file_flipped(name, signed_bundle, keys, tmp_path, workdir):
    """In a signed bundle run with --trust, a flip anywhere (the manifest and its signature too) is refused."""
    b = tmp_path / "bundle"
    shutil.copytree(signed_bundle, b)
    data = bytearray((b / name).read_bytes())
    at = data.index(b'"signature": "') + 20 if name == "manifest.sig" else len(data) // 2
    data[at] ^= 0x01
    (b / name).write_bytes(bytes(data))
    _refused_untouched(b, tmp_path, "bundle", trust=("--trust", keys / "owner.key.pub"))


@pytest.mark.parametrize("name", FILES)
def test_file_deleted(name, bundle, tmp_path, workdir):
    (bundle / name).unlink()
    _refused_untouched(bundle, tmp_path, "expected a regular file" if name == "manifest.json"
                       else f"bundle: {name} listed in the manifest is missing")


@pytest.mark.parametrize("where", ["extra.so", "sub/extra.json", "link_to_etc"])
def test_file_added(where, bundle, tmp_path, workdir):
    p = bundle / where
    p.parent.mkdir(exist_ok=True)
    if where == "link_to_etc":
        p.symlink_to("/etc")
    else:
        p.write_bytes(b"\x7fELF not listed")
    _refused_untouched(bundle, tmp_path, f"bundle: {where} is not listed in the manifest")


def _outside_copy(bundle, tmp_path, name="plan.json"):
    """A file outside the bundle with exactly the content of one inside (its hash in the manifest matches)."""
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    shutil.copy(bundle / name, out / name)
    return out / name


PATH_CASES = ["dotdot", "absolute", "dot_segment", "backslash", "empty"]


@pytest.mark.parametrize("case", PATH_CASES)
def test_manifest_path_outside_the_bundle(case, bundle, tmp_path, workdir):
    outside = _outside_copy(bundle, tmp_path)
    path = {"dotdot": "../outside/plan.json", "absolute": str(outside), "dot_segment": "./plan.json",
            "backslash": "..\\outside\\plan.json", "empty": ""}[case]
    _manifest(bundle, lambda m: _entry(m, "plan.json").update(path=path))
    _refused_untouched(bundle, tmp_path, "file path must stay inside the bundle")


def test_symlink_out_of_the_bundle(bundle, tmp_path, workdir):
    """plan.json replaced by a link to a file outside with the same bytes: the hash matches, the link is refused."""
    outside = _outside_copy(bundle, tmp_path)
    (bundle / "plan.json").unlink()
    (bundle / "plan.json").symlink_to(outside)
    _refused_untouched(bundle, tmp_path, "bundle: plan.json is a symbolic link")


def test_symlinked_directory_out_of_the_bundle(bundle, tmp_path, workdir):
    """A listed file reached through a linked directory: refused as a link too."""
    outside = _outside_copy(bundle, tmp_path)
    (bundle / "sub").symlink_to(outside.parent)
    _manifest(bundle, lambda m: _entry(m, "plan.json").update(path="sub/plan.json"))
    (bundle / "plan.json").unlink()
    _refused_untouched(bundle, tmp_path, "bundle: sub/plan.json is a symbolic link (sub ->")


def test_manifest_a_symlink(bundle, tmp_path, workdir):
    outside = _outside_copy(bundle, tmp_path, "manifest.json")
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").symlink_to(outside)
    _refused_untouched(bundle, tmp_path, "expected a regular file", "found a link")


@pytest.mark.parametrize("case", ["format_version", "unknown_key", "not_json", "size_changed", "cpu_feature"])
def test_manifest_content(case, bundle, tmp_path, workdir):
    if case == "not_json":
        (bundle / "manifest.json").write_text("{\"files\": [")
    else:
        _manifest(bundle, {
            "format_version": lambda m: m.update(format_version=1),
            "unknown_key": lambda m: m.update(run_this="rm -rf /"),
            "size_changed": lambda m: _entry(m, "plan.json").update(size=1),
            "cpu_feature": lambda m: m.update(cpu_features_required=m["cpu_features_required"] + ["amx_fp64"]),
        }[case])
    message = {"format_version": "format_version expected", "unknown_key": "run_this", "not_json": "not valid JSON",
               "size_changed": "bundle: plan.json size expected 1 bytes", "cpu_feature": "this CPU lacks ['amx_fp64']"}
    _refused_untouched(bundle, tmp_path, message[case])
