"""Catalogue of bad weights: safetensors (through `helmc run --weights` and `helmc build`) and GGUF files (through
`helmc build`). Each case checks the one-line message, exit status 2, and that nothing was written or lost: the
damaged input, the bundle and the working directory are byte for byte what they were, and no bundle appears."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from bad_inputs import (ARRAY, GGML_F32, STRING, U32, U8, gguf_file, gguf_kv, gguf_string, tiny_qwen3_kvs,
                        tiny_qwen3_tensors)
from cli_check import cli, refused, tree


# ---- safetensors ----------------------------------------------------------------------------------
def _header(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _pack(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _edit(edit):
    """A damage that rewrites the header (edit(header) -> None) and keeps the data."""
    def damage(model_dir):
        p = os.path.join(model_dir, "model.safetensors")
        header, data = _header(open(p, "rb").read())
        edit(header)
        with open(p, "wb") as f:
            f.write(_pack(header, data))
    return damage


def _bytes(change):
    def damage(model_dir):
        p = os.path.join(model_dir, "model.safetensors")
        raw = open(p, "rb").read()
        with open(p, "wb") as f:
            f.write(change(raw))
    return damage


def _first_two(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    return h[names[0]], h[names[1]]


def _overlap(h):
    a, b = _first_two(h)
    size = b["data_offsets"][1] - b["data_offsets"][0]
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]


def _extra_tensor(model_dir, name):
    """One more tensor, with its own 64 bytes of data at the end: well formed, but not part of the model."""
    p = os.path.join(model_dir, "model.safetensors")
    header, data = _header(open(p, "rb").read())
    header[name] = {"dtype": "F32", "shape": [16], "data_offsets": [len(data), len(data) + 64]}
    with open(p, "wb") as f:
        f.write(_pack(header, data + bytes(64)))


def _shard_index(shard_name):
    def damage(model_dir):
        p = os.path.join(model_dir, "model.safetensors")
        header, _ = _header(open(p, "rb").read())
        index = {"metadata": {}, "weight_map": {k: shard_name for k in header if k != "__metadata__"}}
        with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    return damage


UP = "model.layers.0.mlp.up_proj.weight"
SAFETENSORS_CASES = {
    "header_longer_than_file": (_bytes(lambda r: struct.pack("<Q", len(r)) + r[8:]), "truncated safetensors header"),
    "header_length_2^63": (_bytes(lambda r: struct.pack("<Q", 1 << 63) + r[8:]), "truncated safetensors header"),
    "header_not_json": (_bytes(lambda r: r[:8] + b"\x00not json" + r[17:]), "not valid JSON"),
    "header_a_list": (_bytes(lambda r: _pack_list(r)), "expected a JSON object"),
    "offsets_past_the_end": (_edit(lambda h: h[UP].update(data_offsets=[h[UP]["data_offsets"][0] + (1 << 40),
                                                                        h[UP]["data_offsets"][1] + (1 << 40)])),
                             "past the end of the file"),
    "offsets_not_integers": (_edit(lambda h: h[UP].update(data_offsets=["0", "64"])), "data_offsets [begin, end]"),
    "offsets_overlap": (_edit(_overlap), "overlap"),
    "span_disagrees_with_dtype_and_shape": (_edit(lambda h: h[UP].update(dtype="F16")),
                                            "hold 40960 bytes, expected 20480 for F16 [160, 64]"),
    "unknown_dtype": (_edit(lambda h: h[UP].update(dtype="F8_E9M9")), "dtype expected one of"),
    "shape_disagrees_with_config": (_edit(lambda h: h[UP].update(shape=h[UP]["shape"][::-1])),
                                    f"{UP} shape expected"),
    "missing_tensor": (_edit(lambda h: h.pop(UP)), f"tensor {UP!r} expected"),
    "extra_tensor": (lambda d: _extra_tensor(d, "model.layers.7.mlp.up_proj.weight"),
                     "found 1 more: ['model.layers.7.mlp.up_proj.weight']"),
    "data_truncated": (_bytes(lambda r: r[:len(r) - 100]), "truncated"),
    "empty_file": (_bytes(lambda r: b""), "truncated safetensors header"),
    "index_names_a_missing_shard": (_shard_index("model-00002-of-00002.safetensors"),
                                    "shard model-00002-of-00002.safetensors listed in the index is missing"),
    "index_shard_outside_the_directory": (_shard_index("../model.safetensors"), "shard expected a file name"),
}


def _pack_list(raw: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    return _pack_raw(b"[1, 2, 3]", raw[8 + n:])


def _pack_raw(header: bytes, data: bytes) -> bytes:
    header += b" " * ((-len(header)) % 8)
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_bad_safetensors_at_run(case, tiny, tmp_path, workdir):
    damage, message = SAFETENSORS_CASES[case]
    src, _ = tiny.model("qwen3")
    model = tmp_path / "model"
    shutil.copytree(src, model)
    damage(str(model))
    bundle = tiny.bundle("qwen3")
    before = tree(tmp_path, bundle)
    r = cli("run", bundle, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--weights", model)
    refused(r, message)
    assert tree(tmp_path, bundle) == before


@pytest.mark.parametrize("case", ["shape_disagrees_with_config", "extra_tensor", "offsets_overlap"])
def test_bad_safetensors_at_build(case, tiny, tmp_path, workdir, host_hardware):
    """A build checks the safetensors' headers against config.json too: no bundle for weights run would refuse."""
    damage, message = SAFETENSORS_CASES[case]
    src, _ = tiny.model("qwen3")
    model = tmp_path / "model"
    shutil.copytree(src, model)
    damage(str(model))
    host_hardware.save(str(tmp_path / "hw.json"))
    before = tree(tmp_path)
    refused(cli("build", model, tmp_path / "hw.json", "-o", tmp_path / "bundle"), message)
    assert tree(tmp_path) == before


# ---- GGUF -----------------------------------------------------------------------------------------
def _kvs(**replace):
    """The tiny Qwen3's keys with some replaced ({short key: encoded kv or None to drop})."""
    out = []
    for kv in tiny_qwen3_kvs():
        key = kv[8:8 + struct.unpack("<Q", kv[:8])[0]].decode()
        short = key.removeprefix("qwen3.").replace(".", "_")
        if short in replace:
            if replace[short] is not None:
                out.append(replace[short])
        else:
            out.append(kv)
    return out


def _tensors(drop=(), **replace):
    out = []
    for name, dims, t, data in tiny_qwen3_tensors():
        if name in drop:
            continue
        out.append(replace.get(name.replace(".", "_"), (name, dims, t, data)))
    return out


def _array_of_length(n: int) -> bytes:
    # a u8 array claiming n items, followed by a few bytes only
    return gguf_string("tokenizer.ggml.token_type") + struct.pack("<IIQ", ARRAY, U8, n) + b"\x01\x02"


def _tensor_info_patch(name: str, ggml_type: int | None = None, offset: int | None = None):
    """A whole tiny file with one tensor's type id or offset replaced in its tensor-info record."""
    raw = bytearray(gguf_file(tiny_qwen3_kvs(), tiny_qwen3_tensors()))
    dims = dict((n, d) for n, d, _, _ in tiny_qwen3_tensors())[name]
    at = raw.index(gguf_string(name)) + len(gguf_string(name)) + 4 + 8 * len(dims)
    old_type, old_offset = struct.unpack("<IQ", raw[at:at + 12])
    raw[at:at + 12] = struct.pack("<IQ", old_type if ggml_type is None else ggml_type,
                                  old_offset if offset is None else offset)
    return bytes(raw)


def _good() -> bytes:
    return gguf_file(tiny_qwen3_kvs(), tiny_qwen3_tensors())


Q = "blk.0.attn_q.weight"
GGUF_CASES = {
    "magic": (lambda: b"GGUX" + _good()[4:], "expected the magic b'GGUF'"),
    "version_1": (lambda: gguf_file(tiny_qwen3_kvs(), tiny_qwen3_tensors(), version=1), "GGUF header unreadable"),
    "header_truncated": (lambda: _good()[:300], "truncated"),
    "data_truncated": (lambda: _good()[:-64], "truncated"),
    # a u8 array claiming 2^63 items: read item by item, it must stop at the end of the file, not at 2^63
    "array_length_2^63": (lambda: gguf_file(tiny_qwen3_kvs() + [_array_of_length(1 << 63)], []), "truncated or corrupt"),
    "string_length_2^63": (lambda: gguf_file([struct.pack("<Q", 1 << 63) + b"general.architecture"], []),
                           "truncated or corrupt"),
    "kv_count_2^63": (lambda: gguf_file(tiny_qwen3_kvs(), tiny_qwen3_tensors(), n_kv=1 << 63), "truncated or corrupt"),
    "tensor_count_2^63": (lambda: gguf_file(tiny_qwen3_kvs(), tiny_qwen3_tensors(), n_tensors=1 << 63),
                          "truncated or corrupt"),
    "unknown_value_type": (lambda: gguf_file(tiny_qwen3_kvs() + [gguf_string("x.y") + struct.pack("<I", 99) + b"\0" * 8],
                                             tiny_qwen3_tensors()), "GGUF header unreadable"),
    "unknown_tensor_type": (lambda: _tensor_info_patch(Q, ggml_type=99), "GGML type id 99"),
    "tensor_offset_out_of_range": (lambda: _tensor_info_patch(Q, offset=1 << 40), "past the end of the file"),
    "tensors_overlap": (lambda: _tensor_info_patch("blk.0.attn_k.weight", offset=0), "overlap"),
    "missing_tensor": (lambda: gguf_file(tiny_qwen3_kvs(), _tensors(drop=("blk.0.ffn_up.weight",))),
                       "missing tensor 'blk.0.ffn_up.weight'"),
    "extra_tensor": (lambda: gguf_file(tiny_qwen3_kvs(), tiny_qwen3_tensors() + [
        ("blk.5.ffn_up.weight", (32, 64), GGML_F32, bytes(32 * 64 * 4))]), "unexpected tensor 'blk.5.ffn_up.weight'"),
    "dims_disagree_with_keys": (lambda: gguf_file(tiny_qwen3_kvs(), _tensors(
        blk_0_attn_q_weight=(Q, (32, 64), GGML_F32, bytes(32 * 64 * 4)))), f"tensor {Q!r}"),
    "unsupported_architecture": (lambda: gguf_file(tiny_qwen3_kvs(arch="gpt2"), tiny_qwen3_tensors()),
                                 "general.architecture expected one of"),
    "heads_not_dividing": (lambda: gguf_file(_kvs(attention_head_count_kv=gguf_kv("qwen3.attention.head_count_kv", U32, 3)),
                                             tiny_qwen3_tensors()), "must be a multiple of head_count_kv"),
    "missing_key": (lambda: gguf_file(_kvs(block_count=None), tiny_qwen3_tensors()), "'qwen3.block_count' missing"),
    "key_of_wrong_type": (lambda: gguf_file(_kvs(block_count=gguf_kv("qwen3.block_count", STRING, "one")),
                                            tiny_qwen3_tensors()), "'qwen3.block_count' expected one positive number"),
    "split_file": (lambda: gguf_file(tiny_qwen3_kvs() + [gguf_kv("split.count", U32, 2)], tiny_qwen3_tensors()),
                   "part of a split of 2"),
    "block_count_2^31": (lambda: gguf_file(_kvs(block_count=gguf_kv("qwen3.block_count", U32, 1 << 31)),
                                           tiny_qwen3_tensors()), "num_layers expected a positive integer of at most"),
}


def test_gguf_base_file_is_accepted(tmp_path, hw_json, workdir):
    """The undamaged file the cases start from plans cleanly: each refusal below is the damage's."""
    pytest.importorskip("gguf")
    (tmp_path / "good.gguf").write_bytes(_good())
    r = cli("plan", tmp_path / "good.gguf", hw_json)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_bad_gguf_at_build(case, tmp_path, hw_json, workdir):
    pytest.importorskip("gguf")
    make, message = GGUF_CASES[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make())
    before = tree(tmp_path)
    refused(cli("build", bad, hw_json, "-o", tmp_path / "bundle"), message)
    assert tree(tmp_path) == before                 # no bundle, no temporary directory, the input untouched
