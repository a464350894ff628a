"""Bad input: a clear one-line error naming expected and found, exit status 2, no traceback,
and nothing half-written."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from click.testing import CliRunner

from helmc.cli.main import main


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def assert_clean_error(r, *fragments):
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    err = r.output.strip().splitlines()
    assert err and err[-1].startswith("helmc: error:"), r.output
    for f in fragments:
        assert f in r.output, (f, r.output)


@pytest.fixture
def hw_file(tmp_path, host_hardware):
    p = tmp_path / "hardware.json"
    host_hardware.save(str(p))
    return p


def test_missing_config(tmp_path, hw_file):
    (tmp_path / "empty").mkdir()
    r = cli("build", tmp_path / "empty", hw_file, "-o", tmp_path / "b")
    assert_clean_error(r, "config.json")
    assert not (tmp_path / "b").exists()


def test_unsupported_architecture(tmp_path, hw_file):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    r = cli("build", d, hw_file, "-o", tmp_path / "b")
    assert_clean_error(r, "GPT2LMHeadModel", "Qwen3ForCausalLM")


def test_unknown_key_in_hardware_json(tmp_path, tiny, hw_file):
    model_dir, _ = tiny.model("qwen3")
    data = json.loads(hw_file.read_text())
    data["cpu"]["dram_gbps_typo"] = 10
    hw_file.write_text(json.dumps(data))
    r = cli("build", model_dir, hw_file, "-o", tmp_path / "b")
    assert_clean_error(r, "dram_gbps_typo")


def _copy_model(tiny, tmp_path):
    src, _ = tiny.model("qwen3")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data[8 + n:])


def _run_with_weights(tiny, weights_dir):
    return cli("run", tiny.bundle("qwen3"), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--weights", weights_dir)


def test_truncated_safetensors_header(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:20])
    assert_clean_error(_run_with_weights(tiny, d), "truncated safetensors header")


def test_overlapping_offsets(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path)

    def overlap(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = h[names[0]], h[names[1]]
        size = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]
    _rewrite_header(d / "model.safetensors", overlap)
    assert_clean_error(_run_with_weights(tiny, d), "overlap")


def test_shape_disagrees_with_config(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path)

    def reshape(h):
        t = h["model.layers.0.mlp.up_proj.weight"]
        t["shape"] = [t["shape"][1], t["shape"][0]]
    _rewrite_header(d / "model.safetensors", reshape)
    assert_clean_error(_run_with_weights(tiny, d), "model.layers.0.mlp.up_proj.weight", "shape expected")


def test_modified_library_is_not_loaded(tmp_path, tiny, monkeypatch):
    b = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), b)
    lib = b / "cpu_stage.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    import tvm.runtime
    loaded = []
    monkeypatch.setattr(tvm.runtime, "load_module", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(AssertionError("loaded")))
    r = cli("run", b, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert_clean_error(r, "cpu_stage.so", "sha256")
    assert loaded == []


def test_bundle_needing_missing_cpu_features(tmp_path, tiny):
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.errors import HelmcError
    with pytest.raises(HelmcError, match="lacks"):
        verify_bundle(tiny.bundle("qwen3"), cpu_flags=frozenset({"sse2"}))


def test_prompt_longer_than_plan_allows(tiny):
    from helmc.runtime.session import Session
    s = Session.load(tiny.bundle("qwen3"))
    too_long = ",".join(["5"] * (s.plan.memory.max_context + 1))
    r = cli("run", tiny.bundle("qwen3"), "--prompt-ids", too_long, "--max-new-tokens", "1")
    assert_clean_error(r, "plan allows at most", str(s.plan.memory.max_context))


def test_prompt_ids_not_integers(tiny):
    assert_clean_error(cli("run", tiny.bundle("qwen3"), "--prompt-ids", "1,x"), "--prompt-ids expected")



def test_prefill_activations_outside_the_choices(tmp_path, tiny, hw_file):
    """The CLI refuses a precision it does not offer, and so does the API, before anything is written; a
    bundle records the precision it was built with ("model" by default)."""
    from helmc import api
    from helmc.errors import HelmcError
    from helmc.runtime.bundle.manifest import MANIFEST_NAME, BundleManifest
    model_dir, _ = tiny.model("qwen3")
    r = cli("build", model_dir, hw_file, "-o", tmp_path / "b", "--prefill-activations", "bf16")
    assert r.exit_code == 2 and "'bf16' is not one of 'model', 'fp32'" in r.output, r.output
    with pytest.raises(HelmcError, match=r"prefill activations: expected one of \('model', 'fp32'\), found 'fp64'"):
        api.build(model_dir, str(hw_file), str(tmp_path / "b"), prefill_activations="fp64", quiet=True)
    assert not (tmp_path / "b").exists()
    with open(os.path.join(tiny.bundle("qwen3"), MANIFEST_NAME)) as f:
        assert BundleManifest.from_json(f.read()).prefill_activations == "model"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Qwen3 quantized to q8_0 by helmc's quantize-at-build (a valid GGUF to damage)."""
    pytest.importorskip("gguf")
    from helmc.compiler.quantize_checkpoint import quantize_checkpoint
    from helmc.testing import make_tiny_model
    d = tmp_path_factory.mktemp("gguf")
    make_tiny_model(str(d / "model"), "qwen3", dtype="float16", hidden_size=64, intermediate_size=128)
    return quantize_checkpoint(str(d / "model"), "q8_0", str(d / "cache"))


@pytest.mark.parametrize("damage,expected", [
    ("truncate", "truncated"),
    ("magic", "GGUF"),
    ("text", "GGUF"),
])
def test_bad_gguf_is_refused_and_nothing_written(tmp_path, hw_file, tiny_gguf, damage, expected):
    data = open(tiny_gguf, "rb").read()
    bad = tmp_path / "bad.gguf"
    if damage == "truncate":
        bad.write_bytes(data[:-100])                 # the last tensor's data ends past the end of the file
    elif damage == "magic":
        bad.write_bytes(b"GGUX" + data[4:])
    else:
        bad.write_bytes(b"this is not a model file\n" * 100)
    r = cli("build", bad, hw_file, "-o", tmp_path / "bundle")
    assert_clean_error(r, expected)
    assert not (tmp_path / "bundle").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no half-written temp dir


def test_quant_of_a_gguf_file_is_refused(tmp_path, hw_file, tiny_gguf):
    r = cli("build", tiny_gguf, hw_file, "-o", tmp_path / "bundle", "--quant", "q4_k")
    assert_clean_error(r, "--quant", "GGUF file is already quantized")
    assert not (tmp_path / "bundle").exists()


def test_plan_of_a_gguf_shows_the_weights_format(tiny_gguf, hw_file):
    r = cli("plan", tiny_gguf, hw_file)
    assert r.exit_code == 0, r.output
    assert "weights: embedding float16, 2 blocks q8_0, head q8_0;" in r.output, r.output
