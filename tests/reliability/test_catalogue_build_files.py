"""Catalogue of model directories whose extra files must not reach a bundle: links out of the directory (a
tokenizer.json that points at a secret), and JSON that does not parse or is no tokenizer. `helmc build` refuses each
in one line naming the file, before compiling, and writes nothing; a Hugging Face hub snapshot (links into the
model's blob store) builds as before."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from cli_check import cli, refused, tree


@pytest.fixture
def model(tiny, tmp_path):
    m = tmp_path / "model"
    shutil.copytree(tiny.model("qwen3")[0], m)
    return m


def _link_out(m, name, target, content=None):
    """model/name replaced by a link to target (written first with content, if given)."""
    if content is not None:
        (m / target).write_text(content)
    (m / name).unlink(missing_ok=True)
    (m / name).symlink_to(target)


CASES = {
    # case -> (damage to the model directory, the refusal's words)
    "tokenizer_link_to_a_secret": (lambda m, t: _link_out(m, "tokenizer.json", t / "secret.json",
                                                           '{"api_key": "hunter2"}'), "found a link to"),
    "generation_config_link_to_etc": (lambda m, t: _link_out(m, "generation_config.json", "/etc/passwd"),
                                      "outside it; refusing to copy it"),
    "tokenizer_config_relative_link_out": (lambda m, t: _link_out(m, "tokenizer_config.json", "../outside/x.json", "{}"),
                                           "outside it"),
    "dangling_link": (lambda m, t: _link_out(m, "special_tokens_map.json", t / "nothing"), "special_tokens_map.json"),
    "tokenizer_truncated": (lambda m, t: (m / "tokenizer.json").write_text((m / "tokenizer.json").read_text()[:200]),
                            "tokenizer.json is not valid JSON"),
    "tokenizer_not_a_tokenizer": (lambda m, t: (m / "tokenizer.json").write_text('{"model": {"type": "nope"}}'),
                                  "tokenizer.json is not a tokenizer the tokenizers library reads"),
    "tokenizer_config_not_json": (lambda m, t: (m / "tokenizer_config.json").write_text("{'single': quotes}"),
                                  "tokenizer_config.json is not valid JSON"),
    "generation_config_a_list": (lambda m, t: (m / "generation_config.json").write_text("[1, 2]"),
                                 "generation_config.json expected a JSON object, found list"),
    "tokenizer_not_utf8": (lambda m, t: (m / "tokenizer.json").write_bytes(b'{"a": "\xff\xfe"}'),
                           "tokenizer.json expected UTF-8 text"),
    "tokenizer_nested_deep": (lambda m, t: (m / "tokenizer.json").write_text("[" * 100000 + "]" * 100000),
                              "tokenizer.json is not valid JSON"),
    "tokenizer_a_fifo": (lambda m, t: [(m / "tokenizer.json").unlink(), os.mkfifo(m / "tokenizer.json")],
                         "expected a regular file, found a FIFO"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_build_refuses_model_file(case, model, hw_json, tmp_path, workdir):
    damage, words = CASES[case]
    outside = tmp_path / "outside"
    outside.mkdir()
    damage(model, outside)
    before = tree(tmp_path)
    refused(cli("build", model, hw_json, "-o", tmp_path / "bundle"), words)
    assert tree(tmp_path) == before


def test_hub_snapshot_links_build(tiny, hw_json, tmp_path, workdir):
    """models--X/snapshots/REV/* are links into models--X/blobs/, as the Hugging Face hub cache lays them out: the
    build copies them (their content, not links) and the bundle runs."""
    src = tiny.model("qwen3")[0]
    repo = tmp_path / "models--tiny"
    snap, blobs = repo / "snapshots" / "rev1", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), blobs / f"blob-{name}")
        (snap / name).symlink_to(os.path.join("..", "..", "blobs", f"blob-{name}"))
    r = cli("build", snap, hw_json, "-o", tmp_path / "bundle")
    assert r.exit_code == 0, r.output
    b = tmp_path / "bundle"
    assert not (b / "tokenizer.json").is_symlink()
    assert json.loads((b / "tokenizer.json").read_text()) == json.loads((blobs / "blob-tokenizer.json").read_text())
    assert cli("run", b, "--prompt-ids", "1,2", "--max-new-tokens", "2").exit_code == 0
