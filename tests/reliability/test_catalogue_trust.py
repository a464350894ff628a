"""Catalogue of key-file mistakes and traps: a PRIVATE key given where a public one is expected (refused without
showing any of it), private keys others can read (warned about), special files as keys (a FIFO would block an
open() forever: refused before opening), and `keygen` on paths it cannot write (one line, nothing left behind)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cli_check import cli, refused, tree

RUN = ("--prompt-ids", "1,2,3", "--max-new-tokens", "2")


def _helmc(*args, timeout=120):
    """The real console script in its own process (a blocking open would hang it, not the test run)."""
    helmc = os.path.join(os.path.dirname(sys.executable), "helmc")
    r = subprocess.run([helmc, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    lines = [x for x in r.stderr.splitlines() if x.startswith("helmc:")]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r, lines


def test_private_key_as_trust_is_refused_without_echo(signed_bundle, keys, tmp_path, workdir):
    secret = (keys / "owner.key").read_text()
    body = [line for line in secret.splitlines() if "-----" not in line]
    r = cli("run", signed_bundle, *RUN, "--trust", keys / "owner.key")
    line = refused(r, "found a PRIVATE key (its content not shown)", "KEYFILE.pub")
    for chunk in body:                                   # not one line, not a fragment of 8 characters
        assert chunk not in r.output
        assert all(chunk[i:i + 8] not in r.output for i in range(0, len(chunk) - 8, 4)), line


@pytest.mark.parametrize("content", ["openssh_private", "binary", "junk_line"])
def test_other_non_public_keys_are_not_echoed(content, signed_bundle, tmp_path, workdir):
    p = tmp_path / "k.pub"
    secret = "c2VjcmV0IGtleSBtYXRlcmlhbCB0aGF0IG11c3Qgbm90IGxlYWs="
    data = {"openssh_private": f"-----BEGIN OPENSSH PRIVATE KEY-----\n{secret}\n-----END OPENSSH PRIVATE KEY-----\n",
            "binary": None, "junk_line": f"ssh-ed25519 {secret} me@host\n"}[content]
    if data is None:
        p.write_bytes(b"\x00\xff" + secret.encode())
    else:
        p.write_text(data)
    r = cli("run", signed_bundle, *RUN, "--trust", p)
    refused(r, "trusted key: expected one line")
    assert secret[:12] not in r.output and secret[-12:] not in r.output


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
@pytest.mark.parametrize("option", ["--trust", "--sign"])
def test_key_that_is_a_special_file_is_refused_at_once(kind, option, tiny, signed_bundle, hw_json, tmp_path, workdir):
    p = tmp_path / "key"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    else:
        p = "/dev/zero"
    args = (("run", signed_bundle, *RUN, "--trust", p) if option == "--trust" else
            ("build", tiny.model("qwen3")[0], hw_json, "-o", tmp_path / "out", "--sign", p))
    r, lines = _helmc(*args)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"found a {'FIFO' if kind == 'fifo' else 'device' if kind == 'device' else 'directory'}" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_private_key_readable_by_others_is_warned(keys, tmp_path, workdir, capfd):
    from helmc.runtime.bundle.signature import load_private_key
    shared = tmp_path / "shared.key"
    shutil.copy(keys / "owner.key", shared)
    os.chmod(shared, 0o644)
    load_private_key(str(shared))
    err = capfd.readouterr().err
    assert "helmc: warning: private key" in err and "readable by others (mode 0644)" in err and "chmod 600" in err
    os.chmod(shared, 0o640)
    load_private_key(str(shared))
    assert "readable by its group (mode 0640)" in capfd.readouterr().err
    os.chmod(shared, 0o600)
    load_private_key(str(shared))
    assert "warning" not in capfd.readouterr().err


@pytest.mark.parametrize("case", ["missing_directory", "under_a_file", "in_proc", "empty", "a_directory",
                                  "read_only_directory"])
def test_keygen_on_a_bad_path(case, tmp_path, workdir):
    (tmp_path / "file").write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    path = {"missing_directory": tmp_path / "nope" / "k", "under_a_file": tmp_path / "file" / "k",
            "in_proc": "/proc/helmc-key", "empty": "", "a_directory": str(tmp_path) + "/",
            "read_only_directory": ro / "k"}[case]
    if case == "read_only_directory" and os.access(ro, os.W_OK):
        pytest.skip("running as a user who can write a 0500 directory (root)")
    before = tree(tmp_path)
    refused(cli("keygen", path), "keygen: expected")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_model_file_that_is_a_fifo_is_refused_at_once(name, tiny, hw_json, tmp_path, workdir):
    model = tmp_path / "model"
    shutil.copytree(tiny.model("qwen3")[0], model)
    (model / name).unlink()
    os.mkfifo(model / name)
    r, lines = _helmc("build", model, hw_json, "-o", tmp_path / "out")
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert name in lines[0] and ("found a FIFO" in lines[0] or "is missing" in lines[0]), lines
