"""Signed bundles, tried as an attacker would.

The attack: a bundle's cpu_stage.so replaced by a library whose constructor writes a file, and manifest.json
rewritten with the new sha256 and size, so every hash check passes. Against a bundle signed by `helmc build
--sign`, run (and serve) with `--require-signed --trust owner.key.pub` refuse it in one line, before any library
is loaded: the constructor's file never appears and the library is not mapped into the process. The same when the
attacker also re-signs the manifest with a key of their own, or removes the signature. A control shows the attack
is real: without --require-signed the unsigned bundle's library is loaded, and its constructor runs (the error
that follows is still one line).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat

import pytest

from cli_check import cli, refused, tree

RUN = ("--prompt-ids", "1,2,3", "--max-new-tokens", "3")


def _tamper(bundle, evil: str, resign_with=None, drop_signature: bool = False):
    """The attack on a copy of a bundle: cpu_stage.so replaced, its manifest entry rewritten to match."""
    shutil.copy(evil, bundle / "cpu_stage.so")
    m = json.loads((bundle / "manifest.json").read_text())
    data = (bundle / "cpu_stage.so").read_bytes()
    for f in m["files"]:
        if f["path"] == "cpu_stage.so":
            f.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    if resign_with is not None:
        from helmc.runtime.bundle.signature import load_private_key, sign_manifest
        sign_manifest(str(bundle / "manifest.json"), load_private_key(str(resign_with)))
    if drop_signature:
        (bundle / "manifest.sig").unlink()


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return os.path.realpath(path) in f.read()


def _tokens(r) -> list[int]:
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens"]


def test_keygen_writes_a_key_pair_and_never_overwrites(keys, workdir):
    key, pub = keys / "owner.key", keys / "owner.key.pub"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert b"PRIVATE KEY" in key.read_bytes()
    word, b64 = pub.read_text().split()
    assert word == "helmc-ed25519" and len(b64) == 44
    before = tree(keys)
    refused(cli("keygen", key), "refusing to overwrite a key")
    assert tree(keys) == before


def test_signed_bundle_runs_with_its_key(signed_bundle, keys, tiny, workdir):
    """--trust FILE and HELMC_TRUSTED_KEYS=DIR both accept the owner's signature; tokens as the unsigned bundle's."""
    assert (signed_bundle / "manifest.sig").is_file()
    want = _tokens(cli("run", tiny.bundle("qwen3"), *RUN, "--json"))
    assert _tokens(cli("run", signed_bundle, *RUN, "--json", "--require-signed", "--trust", keys / "owner.key.pub")) == want
    trusted = workdir.parent / "trusted"
    trusted.mkdir()
    shutil.copy(keys / "owner.key.pub", trusted)
    assert _tokens(cli("run", signed_bundle, *RUN, "--json", "--require-signed",
                       env={"HELMC_TRUSTED_KEYS": str(trusted)})) == want


ATTACKS = {
    # (how the attacker changes the bundle, the refusal's words)
    "library_replaced_manifest_rewritten": ({}, "is invalid: the manifest was modified after signing"),
    "and_resigned_by_an_untrusted_key": ({"resign": True}, "expected one of the trusted keys"),
    "and_signature_removed": ({"drop_signature": True}, "expected a signed bundle"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("command", ["run", "serve"])
def test_attack_refused_before_any_library_loads(attack, command, signed_bundle, keys, evil_library, tmp_path, workdir):
    how, message = ATTACKS[attack]
    marker = tmp_path / "constructor-ran"
    bundle = tmp_path / "bundle"
    shutil.copytree(signed_bundle, bundle)
    _tamper(bundle, evil_library(marker), keys / "attacker.key" if how.get("resign") else None,
            how.get("drop_signature", False))
    before = tree(tmp_path)
    args = RUN if command == "run" else ("--port", "0")
    line = refused(cli(command, bundle, *args, "--require-signed", "--trust", keys / "owner.key.pub"), message)
    assert not marker.exists(), "the attacker's constructor ran"
    assert not _mapped(bundle / "cpu_stage.so"), "the attacker's library was loaded"
    assert tree(tmp_path) == before
    print(line)


def test_bundle_signed_by_an_untrusted_key(signed_bundle, keys, evil_library, tmp_path, workdir):
    """A whole bundle signed by someone else (no file changed but the signature): refused, by --trust and by
    HELMC_TRUSTED_KEYS alike."""
    bundle = tmp_path / "bundle"
    shutil.copytree(signed_bundle, bundle)
    from helmc.runtime.bundle.signature import load_private_key, sign_manifest
    sign_manifest(str(bundle / "manifest.json"), load_private_key(str(keys / "attacker.key")))
    refused(cli("run", bundle, *RUN, "--trust", keys / "owner.key.pub"), "expected one of the trusted keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(keys / "owner.key.pub", trusted)
    refused(cli("run", bundle, *RUN, "--require-signed", env={"HELMC_TRUSTED_KEYS": str(trusted)}),
            "expected one of the trusted keys")


def test_control_the_attack_is_real_without_require_signed(tiny, evil_library, tmp_path, workdir):
    """An unsigned bundle, run without --require-signed, is trusted as it is: the attacker's constructor runs as
    the library loads (which is why --require-signed exists); helmc still ends in one typed line."""
    marker = tmp_path / "constructor-ran"
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), bundle)
    _tamper(bundle, evil_library(marker))
    refused(cli("run", bundle, *RUN), "cpu_stage.so expected a helmc stage library")
    assert marker.read_text() == "constructor ran\n"


@pytest.mark.parametrize("case", ["no_trusted_key", "unsigned_bundle", "unsigned_bundle_trust_alone",
                                  "trust_file_missing", "trust_file_not_a_key",
                                  "trusted_keys_dir_missing", "sign_key_not_a_key"])
def test_signature_options_refused(case, tiny, keys, hw_json, tmp_path, workdir):
    bundle = tiny.bundle("qwen3")
    junk = tmp_path / "junk.pub"
    junk.write_text("ssh-rsa AAAA not a helmc key\n")
    args, env, message = {
        "no_trusted_key": (("run", bundle, *RUN, "--require-signed"), None, "expected at least one trusted key"),
        "unsigned_bundle": (("run", bundle, *RUN, "--require-signed", "--trust", keys / "owner.key.pub"), None,
                            "expected a signed bundle"),
        # --trust names the signers: an attacker who deletes manifest.sig must not get past it.
        "unsigned_bundle_trust_alone": (("run", bundle, *RUN, "--trust", keys / "owner.key.pub"), None,
                                        "expected a signed bundle"),
        "trust_file_missing": (("run", bundle, *RUN, "--trust", tmp_path / "nope.pub"), None, "could not read"),
        "trust_file_not_a_key": (("run", bundle, *RUN, "--trust", junk), None, "expected one line 'helmc-ed25519"),
        "trusted_keys_dir_missing": (("run", bundle, *RUN), {"HELMC_TRUSTED_KEYS": str(tmp_path / "nope")},
                                     "HELMC_TRUSTED_KEYS: expected a directory"),
        "sign_key_not_a_key": (("build", tiny.model("qwen3")[0], hw_json, "-o", tmp_path / "out", "--sign", junk), None,
                               "expected an unencrypted ed25519 private key"),
    }[case]
    before = tree(tmp_path, bundle)
    refused(cli(*args, env=env), message)
    assert tree(tmp_path, bundle) == before


@pytest.mark.parametrize("damage", ["not_json", "too_large", "wrong_algorithm", "signature_not_base64", "a_symlink",
                                    "a_directory"])
def test_damaged_signature_file(damage, signed_bundle, keys, tmp_path, workdir):
    bundle = tmp_path / "bundle"
    shutil.copytree(signed_bundle, bundle)
    sig = bundle / "manifest.sig"
    doc = json.loads(sig.read_text())
    if damage == "not_json":
        sig.write_text("{not json")
    elif damage == "too_large":
        sig.write_text(json.dumps(dict(doc, padding="x" * 5000)))
    elif damage == "wrong_algorithm":
        sig.write_text(json.dumps(dict(doc, algorithm="rsa")))
    elif damage == "signature_not_base64":
        sig.write_text(json.dumps(dict(doc, signature="!!!")))
    elif damage == "a_symlink":
        (tmp_path / "elsewhere.sig").write_text(sig.read_text())
        sig.unlink()
        sig.symlink_to(tmp_path / "elsewhere.sig")
    else:
        sig.unlink()
        sig.mkdir()
    before = tree(tmp_path)
    refused(cli("run", bundle, *RUN, "--trust", keys / "owner.key.pub"), "manifest.sig")
    assert tree(tmp_path) == before


def test_library_swapped_after_verification_is_never_loaded(tiny, evil_library, tmp_path, workdir, monkeypatch):
    """The race between hashing and loading: the bundle verifies, then cpu_stage.so is replaced before it loads.
    helmc loads the bytes it hashed (bundle.library: a private in-memory copy, checked against the verified
    manifest), never the path: `helmc run` refuses in one typed line and the swapped-in constructor never runs;
    the genuine library loads from the copy, so the bundle's file is never mapped into the process."""
    import helmc.runtime.session as session_module
    from helmc.runtime.bundle.library import verified_library
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.runtime.cpu_stage import CPU_STAGE_LIB, load_stage_library
    marker = tmp_path / "constructor-ran"
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), bundle)
    lib, good = bundle / CPU_STAGE_LIB, (bundle / CPU_STAGE_LIB).read_bytes()
    evil = evil_library(marker)

    def verify_then_swap(*args, **kwargs):
        manifest = verify_bundle(*args, **kwargs)
        shutil.copy(evil, lib)                                  # after every hash passed, before any load
        return manifest
    monkeypatch.setattr(session_module, "verify_bundle", verify_then_swap)
    refused(cli("run", bundle, *RUN), "cpu_stage.so changed after it was verified")
    assert not marker.exists() and not _mapped(lib)
    monkeypatch.undo()
    lib.write_bytes(good)
    manifest = verify_bundle(str(bundle))
    with verified_library(str(bundle), manifest, CPU_STAGE_LIB) as path:
        shutil.copy(evil, lib)                                  # swapped while the copy is held: the copy stays
        with open(path, "rb") as f:
            assert not path.startswith(str(bundle)) and f.read() == good
    lib.write_bytes(good)
    assert load_stage_library(str(bundle), manifest, CPU_STAGE_LIB) is not None
    assert not _mapped(lib) and not marker.exists()
