"""What `helmc build` copies out of a model directory into a bundle: only files that are inside that directory,
and only JSON that parses.

A bundle is shared and, with --sign, signed: a `tokenizer.json` that is a symbolic link to ~/.ssh/id_ed25519 or
/etc/shadow must not be copied into it. A file is copied when its real path lies inside the model directory's real
path, or inside the Hugging Face hub cache's blob store of that model (a snapshot directory
`models--X/snapshots/REV/` holds links to `models--X/blobs/`, and that is how downloaded models look). Every JSON
copied is parsed first, tokenizer.json also by the tokenizers library the runtime loads it with, so a malformed
one fails the build, naming the file, instead of the first run.
"""
from __future__ import annotations

import json
import os
import shutil

from helmc.errors import HelmcError
from helmc.jsonio import read_regular_file, require_regular_file

_MAX_TEXT_BYTES = 1 << 30          # a tokenizer.json of a 256k vocabulary is ~30 MB


def allowed_roots(model_dir: str) -> tuple[str, ...]:
    """The model directory's real path, and its hub cache's blob store where it is a snapshot directory."""
    real = os.path.realpath(model_dir)
    roots = [real]
    parent = os.path.dirname(os.path.abspath(model_dir))
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")))
    return tuple(roots)


def inside_model_dir(model_dir: str, name: str) -> str:
    """The path of model_dir/name after checking that it resolves inside allowed_roots and is a regular file."""
    path = os.path.join(model_dir, name)
    real = os.path.realpath(path)
    if not any(os.path.commonpath([root, real]) == root for root in allowed_roots(model_dir)):
        raise HelmcError(f"build: expected {name} inside the model directory {model_dir}, found a link to {real} "
                         f"outside it; refusing to copy it into the bundle")
    require_regular_file(path, f"build: {name}")
    return path


def _validate(name: str, data: bytes, path: str) -> None:
    try:
        text = data.decode("utf-8")
        doc = json.loads(text) if name.endswith(".json") else None
    except UnicodeDecodeError:
        raise HelmcError(f"build: {path} expected UTF-8 text, found other bytes") from None
    except (ValueError, RecursionError) as e:
        raise HelmcError(f"build: {path} is not valid JSON ({getattr(e, 'msg', type(e).__name__)}"
                         f"{f' at line {e.lineno}' if hasattr(e, 'lineno') else ''})") from None
    if name.endswith(".json") and not isinstance(doc, dict):
        raise HelmcError(f"build: {path} expected a JSON object, found {type(doc).__name__}")
    if name == "tokenizer.json":
        from tokenizers import Tokenizer
        try:
            Tokenizer.from_str(text)
        except Exception as e:        # the library's own parse error, whatever its type
            raise HelmcError(f"build: {path} is not a tokenizer the tokenizers library reads "
                             f"({' '.join(str(e).split())[:160]})") from None


# What a bundle takes from a Hugging Face model directory beside the weights (write_bundle copies them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def check_model_files(model_dir: str) -> None:
    """Every TOKENIZER_FILES file model_dir has: inside it and valid (read_model's early check, before compiling)."""
    for name in TOKENIZER_FILES:
        if os.path.lexists(os.path.join(model_dir, name)):
            path = inside_model_dir(model_dir, name)
            _validate(name, read_regular_file(path, f"build: {name}", limit=_MAX_TEXT_BYTES), path)


def copy_text_file(model_dir: str, name: str, dest: str) -> None:
    """model_dir/name (inside it, valid) written to dest: the bytes checked are the bytes written."""
    path = inside_model_dir(model_dir, name)
    data = read_regular_file(path, f"build: {name}", limit=_MAX_TEXT_BYTES)
    _validate(name, data, path)
    with open(dest, "wb") as f:
        f.write(data)


def copy_weight_file(model_dir: str, name: str, dest: str) -> None:
    """A weight file (or its index / config, validated as JSON) copied from inside model_dir."""
    if name.endswith(".json"):
        copy_text_file(model_dir, name, dest)
        return
    shutil.copyfile(inside_model_dir(model_dir, name), dest)
