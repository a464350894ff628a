"""Signed bundles pin their weights: the manifest lists each weight file's size and digest, so swapping the
safetensors beside a signed bundle (the weights stay in the model directory, mmapped) is refused by
`--require-signed --trust` in one line, before any tensor is bound; an unsigned bundle runs as before."""
from __future__ import annotations

import json
import shutil

import pytest

from cli_check import cli, refused
from helmc.runtime.bundle.weights_digest import CHUNK_BYTES, DIGEST_ALGORITHM, file_digest

RUN = ("--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json")


@pytest.fixture(scope="module")
def pinned(tiny, cache_dir, host_hardware, keys, tmp_path_factory):
    """A copy of the tiny Qwen3's model directory and a bundle signed by owner.key built from it (weights beside)."""
    tiny.bundle("qwen3")
    d = tmp_path_factory.mktemp("pinned")
    model = d / "model"
    shutil.copytree(tiny.model("qwen3")[0], model)
    host_hardware.save(str(d / "hw.json"))
    r = cli("build", model, d / "hw.json", "-o", d / "bundle", "--sign", keys / "owner.key",
            env={"HELMC_CACHE_DIR": cache_dir})
    assert r.exit_code == 0, r.output
    return model, d / "bundle"


def _tokens(r):
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens"]


def test_manifest_lists_every_weight_file(pinned):
    model, bundle = pinned
    m = json.loads((bundle / "manifest.json").read_text())
    files = {w["path"]: w for w in m["weights"]}
    assert set(files) == {"model.safetensors"}
    size, digest = file_digest(str(model / "model.safetensors"))
    assert files["model.safetensors"] == {"path": "model.safetensors", "size": size, "digest": digest}


@pytest.mark.parametrize("swap", ["one_byte", "other_weights_same_size", "truncated", "extra_shard", "removed"])
def test_swapped_weights_are_refused(swap, pinned, keys, tmp_path, workdir):
    model, bundle = pinned
    st = model / "model.safetensors"
    good = st.read_bytes()
    try:
        if swap == "one_byte":
            data = bytearray(good)
            data[-3] ^= 0x10
            st.write_bytes(bytes(data))
        elif swap == "other_weights_same_size":
            header_len = int.from_bytes(good[:8], "little") + 8
            st.write_bytes(good[:header_len] + bytes(reversed(good[header_len:])))
        elif swap == "truncated":
            st.write_bytes(good[:-64])
        elif swap == "extra_shard":
            (model / "model-extra.safetensors").write_bytes(good)
        else:
            st.unlink()
        words = {"one_byte": f"{DIGEST_ALGORITHM} expected", "other_weights_same_size": "refusing swapped weights",
                 "truncated": "size expected", "extra_shard": "unlisted ['model-extra.safetensors']",
                 "removed": "missing ['model.safetensors']"}[swap]
        refused(cli("run", bundle, *RUN, "--trust", keys / "owner.key.pub"), "weights:", words)
    finally:
        st.write_bytes(good)
        (model / "model-extra.safetensors").unlink(missing_ok=True)


def test_pinned_weights_run_and_unsigned_runs_as_before(pinned, keys, tiny, workdir):
    """The genuine weights run under --trust (tokens as the unsigned bundle's); the same bundle without
    --require-signed still runs a changed checkpoint, as unsigned bundles always have."""
    model, bundle = pinned
    want = _tokens(cli("run", tiny.bundle("qwen3"), *RUN))
    assert _tokens(cli("run", bundle, *RUN, "--trust", keys / "owner.key.pub")) == want
    st = model / "model.safetensors"
    good = st.read_bytes()
    try:
        data = bytearray(good)
        data[-3] ^= 0x10
        st.write_bytes(bytes(data))
        assert cli("run", bundle, *RUN).exit_code == 0
    finally:
        st.write_bytes(good)


def test_digest_covers_every_chunk(tmp_path):
    """The chunked digest changes with a byte flipped in any chunk and with the length, and does not depend on
    the number of threads."""
    p = tmp_path / "w.bin"
    data = bytearray(range(256)) * ((2 * CHUNK_BYTES + 4096) // 256)
    p.write_bytes(bytes(data))
    base = file_digest(str(p), threads=1)
    assert file_digest(str(p), threads=3) == base
    for at in (0, CHUNK_BYTES - 1, CHUNK_BYTES, len(data) - 1):
        data[at] ^= 1
        p.write_bytes(bytes(data))
        assert file_digest(str(p))[1] != base[1], at
        data[at] ^= 1
    p.write_bytes(bytes(data) + b"\0")
    assert file_digest(str(p))[1] != base[1]
