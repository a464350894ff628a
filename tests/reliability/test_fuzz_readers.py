"""Fuzzers (hypothesis) over every reader of untrusted bytes: the safetensors header, the GGUF header, the
JSON loaders (plan, hardware profile, bundle manifest, model spec, Hugging Face config.json), and a real bundle's
manifest.json and manifest.sig as verify_bundle reads them.

Each example either reads or fails with a HelmcError: any other exception fails the test. Time is bounded per
example (hypothesis' deadline) and memory over the whole run (the process's peak RSS may grow by at most
MEMORY_GROWTH_LIMIT: a length field of 2^63 must never become an allocation). Counts are fixed and
derandomized so CI runs the same ~3500 examples every time (EXAMPLES below).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import resource
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bad_inputs import gguf_file, gguf_kv, safetensors_bytes, tiny_gguf_bytes, tiny_qwen3_kvs, tiny_qwen3_tensors, \
    tiny_safetensors
from helmc.errors import HelmcError

EXAMPLES = {"safetensors_header": 500, "safetensors_bytes": 300, "gguf_mutation": 500, "gguf_structure": 200,
            "json_mutation": 250, "json_any": 60, "hf_config": 300,     # x4 and x5 loaders for the two json_* ones
            "bundle_manifest": 200, "bundle_signature": 150}
MEMORY_GROWTH_LIMIT = 256 << 20
FUZZ = dict(deadline=2000, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                   HealthCheck.data_too_large])
_names = itertools.count()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(autouse=True)
def bounded_memory():
    before = _peak_rss()
    yield
    grown = _peak_rss() - before
    assert grown < MEMORY_GROWTH_LIMIT, f"peak RSS grew by {grown >> 20} MiB while fuzzing"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _write(scratch, data: bytes, suffix: str) -> str:
    # a fresh name per example: the GGUF header cache is keyed by path, size and mtime
    path = os.path.join(scratch, f"{next(_names)}{suffix}")
    with open(path, "wb") as f:
        f.write(data)
    return path


# ---- safetensors ----------------------------------------------------------------------------------
def _read_safetensors(path: str):
    from helmc.runtime.weights.safetensors_mmap import SafetensorsFile
    try:
        sf = SafetensorsFile(path)
    except HelmcError:
        return
    size = os.path.getsize(path)
    for name, info in sf.tensors.items():          # what was accepted lies inside the file, whole
        assert 0 <= info.begin <= info.end <= size, (name, info)
        assert sf.view(name).nbytes == info.end - info.begin
    sf.close()


_ints = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**32, 2**62, 2**63, 2**64, -2**63]))
_json_leaf = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False, allow_infinity=False),
                       st.text(max_size=6))
_json = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=8)
_tensor_entry = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "f32"]), _json_leaf),
     "shape": st.one_of(st.lists(_ints, max_size=3), _json_leaf),
     "data_offsets": st.one_of(st.lists(_ints, min_size=2, max_size=2), st.lists(_json_leaf, max_size=3), _json_leaf)})


@settings(max_examples=EXAMPLES["safetensors_header"], **FUZZ)
@given(header=st.dictionaries(st.text(max_size=4), st.one_of(_tensor_entry, _json), max_size=4),
       data_len=st.integers(0, 200))
def test_safetensors_header_fuzz(scratch, header, data_len):
    _read_safetensors(_write(scratch, safetensors_bytes(header, bytes(data_len)), ".safetensors"))


@settings(max_examples=EXAMPLES["safetensors_bytes"], **FUZZ)
@given(data=st.data())
def test_safetensors_bytes_fuzz(scratch, data):
    """A valid file's bytes, some overwritten, the header length replaced, or cut short."""
    header, payload = tiny_safetensors()
    raw = bytearray(safetensors_bytes(header, payload))
    how = data.draw(st.sampled_from(["bytes", "length", "truncate"]))
    if how == "bytes":
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif how == "length":
        raw[:8] = struct.pack("<Q", data.draw(st.one_of(st.integers(0, len(raw)), st.integers(0, 2**64 - 1))))
    else:
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    _read_safetensors(_write(scratch, bytes(raw), ".safetensors"))


# ---- GGUF -----------------------------------------------------------------------------------------
def _read_gguf(path: str):
    from helmc.model.gguf_spec import check_gguf_tensors, read_gguf_header, spec_from_gguf_header
    from helmc.runtime.weights.gguf_mmap import GGUFCheckpoint
    try:
        header = read_gguf_header(path)
        spec = spec_from_gguf_header(header)
        check_gguf_tensors(header, spec)
        ck = GGUFCheckpoint(path, spec)
    except HelmcError:
        return
    size = os.path.getsize(path)
    for name in ck.names():                        # every accepted tensor is a whole window on the file
        info = ck.info(name)
        assert info.offset + info.nbytes <= size
        assert ck.raw(name).nbytes == info.nbytes
    ck.close()


@pytest.fixture(scope="module")
def gguf_valid():
    pytest.importorskip("gguf")
    return tiny_gguf_bytes()


def _header_end(data: bytes) -> int:
    """Where a tiny_gguf_bytes file's tensor data starts: mutations aim at the header before it."""
    kv_and_info = len(b"".join(tiny_qwen3_kvs())) + sum(8 + len(n) + 4 + 8 * len(d) + 12
                                                       for n, d, _, _ in tiny_qwen3_tensors())
    return 24 + kv_and_info


@settings(max_examples=EXAMPLES["gguf_mutation"], **FUZZ)
@given(data=st.data())
def test_gguf_header_mutation_fuzz(scratch, gguf_valid, data):
    """Bytes of the header overwritten, a 4- or 8-byte field set to an extreme, or the file cut short."""
    raw = bytearray(gguf_valid)
    end = _header_end(gguf_valid)
    how = data.draw(st.sampled_from(["bytes", "u64", "u32", "truncate"]))
    if how == "bytes":
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, end - 1))] = data.draw(st.integers(0, 255))
    elif how in ("u64", "u32"):
        width, fmt = (8, "<Q") if how == "u64" else (4, "<I")
        at = data.draw(st.integers(4, end - width))
        value = data.draw(st.one_of(st.sampled_from([0, 1, 2**(8 * width - 1), 2**(8 * width) - 1, 2**31, 13, 30]),
                                    st.integers(0, 2**(8 * width) - 1)))
        raw[at:at + width] = struct.pack(fmt, value)
    else:
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    _read_gguf(_write(scratch, bytes(raw), ".gguf"))


@settings(max_examples=EXAMPLES["gguf_structure"], **FUZZ)
@given(data=st.data())
def test_gguf_structure_fuzz(scratch, gguf_valid, data):
    """Well-formed GGUF files with wrong content: hyper-parameters of any value and type, tensors dropped,
    dims changed, type ids anywhere in 0..40."""
    kvs = tiny_qwen3_kvs()
    tensors = tiny_qwen3_tensors()
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["kv", "drop_kv", "dims", "type", "drop_tensor"]))
        if what == "kv":
            key = data.draw(st.sampled_from(["qwen3.block_count", "qwen3.embedding_length", "qwen3.attention.head_count",
                                             "qwen3.attention.head_count_kv", "qwen3.attention.key_length",
                                             "qwen3.feed_forward_length", "qwen3.context_length", "split.count",
                                             "qwen3.rope.scaling.type", "qwen3.rope.scaling.factor",
                                             "tokenizer.ggml.eos_token_id", "qwen3.vocab_size"]))
            vtype = data.draw(st.sampled_from([0, 4, 5, 6, 7, 8, 10, 11]))
            value = {8: data.draw(st.text(max_size=5)), 7: data.draw(st.booleans()),
                     6: data.draw(st.floats(-1e6, 1e6)), 5: data.draw(st.integers(-2**31, 2**31 - 1)),
                     11: data.draw(st.integers(-2**63, 2**63 - 1)), 0: data.draw(st.integers(0, 255))}.get(
                vtype, data.draw(st.integers(0, 2**32 - 1)))
            kvs = [k for k in kvs if key.encode() not in k[:60]] + [gguf_kv(key, vtype, value)]
        elif what == "drop_kv" and len(kvs) > 1:
            kvs.pop(data.draw(st.integers(1, len(kvs) - 1)))
        elif what == "dims":
            i = data.draw(st.integers(0, len(tensors) - 1))
            n, dims, t, payload = tensors[i]
            dims = tuple(data.draw(st.lists(st.sampled_from([0, 1, 2, 31, 32, 64, 256, 2**40]), min_size=1, max_size=4)))
            tensors[i] = (n, dims, t, payload)
        elif what == "type":
            i = data.draw(st.integers(0, len(tensors) - 1))
            n, dims, _, payload = tensors[i]
            tensors[i] = (n, dims, data.draw(st.integers(0, 40)), payload)
        elif what == "drop_tensor":
            tensors.pop(data.draw(st.integers(0, len(tensors) - 1)))
    _read_gguf(_write(scratch, gguf_file(kvs, tensors), ".gguf"))


def test_gguf_fuzz_base_file_reads(scratch, gguf_valid):
    """The fuzzers' starting point is a valid tiny Qwen3 file (so a mutation is what the reader refuses)."""
    from helmc.model.gguf_spec import read_gguf_spec
    spec = read_gguf_spec(_write(scratch, gguf_valid, ".gguf"))
    assert (spec.architecture, spec.hidden_size, spec.num_layers) == ("Qwen3ForCausalLM", 32, 1)


# ---- JSON loaders ---------------------------------------------------------------------------------
def _documents() -> dict:
    """A valid document of each loader, and the loader (text -> object)."""
    from helmc.hardware.profile import HardwareProfile, load_hardware
    from helmc.model.spec import ModelSpec
    from helmc.runtime.bundle.manifest import BundleFile, BundleManifest
    from helmc.runtime.bundle.plan import Plan
    from helmc.jsonio import parse_json
    from helmc.testing import tiny_config
    hw = load_hardware("rtx4060-laptop")
    cfg = tiny_config("qwen3", num_layers=2, head_dim=32, dtype="float32").to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    from helmc.planner.search_partition import plan as search
    plan = search(spec, hw)
    manifest = BundleManifest(format_version=2, helmc_version="0.1.0", tvm_version="0.27", model_arch_hash="ab",
                              model_config_sha256="cd", hardware_hash="ef", target_hash="01",
                              cpu_features_required=("avx2",), llvm_target="llvm", cuda_arch="", weights_dir="/w",
                              files=(BundleFile("cpu_stage.so", "0" * 64, 10), BundleFile("plan.json", "1" * 64, 5)))
    return {"plan": (plan.to_json(), Plan.from_json), "hardware": (hw.to_json(), HardwareProfile.from_json),
            "manifest": (manifest.to_json(), BundleManifest.from_json), "model_spec": (spec.to_json(), ModelSpec.from_json),
            "hf_config": (json.dumps(cfg), lambda text: ModelSpec.from_hf_config(parse_json(text, "config.json")))}


@pytest.fixture(scope="module")
def documents():
    return _documents()


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _mutate(doc, data):
    paths = [p for p in _paths(doc) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        how = data.draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if how == "replace":
            parent[path[-1]] = data.draw(_json)
        elif how == "delete" and isinstance(parent, dict):
            parent.pop(path[-1])
        elif how == "delete" and isinstance(parent, list):
            parent.pop(path[-1])
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6))] = data.draw(_json)
        paths = [p for p in _paths(doc) if p]
    return doc


def _load(loader, text):
    try:
        obj = loader(text)
    except HelmcError:
        return
    if dataclasses.is_dataclass(obj) and hasattr(obj, "to_json"):
        type(obj).from_json(obj.to_json())           # what was accepted writes and reads back


@pytest.mark.parametrize("kind", ["plan", "hardware", "manifest", "model_spec"])
@settings(max_examples=EXAMPLES["json_mutation"], **FUZZ)
@given(data=st.data())
def test_json_loader_mutation_fuzz(documents, kind, data):
    text, loader = documents[kind]
    _load(loader, json.dumps(_mutate(json.loads(text), data)))


@pytest.mark.parametrize("kind", ["plan", "hardware", "manifest", "model_spec", "hf_config"])
@settings(max_examples=EXAMPLES["json_any"], **FUZZ)
@given(text=st.one_of(_json.map(json.dumps), st.text(max_size=30), st.just("[" * 100000)))
def test_json_loader_any_text_fuzz(documents, kind, text):
    _load(documents[kind][1], text)


@settings(max_examples=EXAMPLES["hf_config"], **FUZZ)
@given(data=st.data())
def test_hf_config_mutation_fuzz(documents, data):
    text, loader = documents["hf_config"]
    _load(loader, json.dumps(_mutate(json.loads(text), data)))


# ---- a real bundle's manifest and signature, through verify_bundle ---------------------------------
@pytest.fixture(scope="module")
def signed_copy(signed_bundle, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-bundle") / "bundle"
    shutil.copytree(signed_bundle, d)
    return d, (d / "manifest.json").read_text(), (d / "manifest.sig").read_text()


@settings(max_examples=EXAMPLES["bundle_manifest"], **FUZZ)
@given(data=st.data())
def test_verify_bundle_manifest_fuzz(signed_copy, data):
    """manifest.json mutated (unsigned: the signature removed): verify_bundle accepts it or raises a HelmcError."""
    from helmc.runtime.bundle.manifest import verify_bundle
    d, manifest, _ = signed_copy
    (d / "manifest.sig").unlink(missing_ok=True)
    (d / "manifest.json").write_text(json.dumps(_mutate(json.loads(manifest), data)))
    try:
        verify_bundle(str(d))
    except HelmcError:
        pass


@settings(max_examples=EXAMPLES["bundle_signature"], **FUZZ)
@given(data=st.data())
def test_verify_bundle_signature_fuzz(signed_copy, keys, data):
    """manifest.sig mutated, the owner's key trusted: refused with a HelmcError unless the signature and its key
    are still the signer's own."""
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.runtime.bundle.signature import load_public_key
    d, manifest, sig = signed_copy
    (d / "manifest.json").write_text(manifest)
    doc = _mutate(json.loads(sig), data)
    (d / "manifest.sig").write_text(json.dumps(doc) if data.draw(st.booleans()) else json.dumps(doc)[:-3])
    try:
        verify_bundle(str(d), trusted_keys=(load_public_key(str(keys / "owner.key.pub")),), require_signed=True)
    except HelmcError:
        return
    original = json.loads(sig)
    assert isinstance(doc, dict) and doc.get("signature") == original["signature"] \
        and doc.get("key_fingerprint") == original["key_fingerprint"], doc
