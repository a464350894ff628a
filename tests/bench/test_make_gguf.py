"""benchmarks/make_gguf.py: random-weight GGUF files typed as llama.cpp's Q5_K_M and Q4_K_M files are, at a tiny size.

- Each file reads back with the gguf package's reader; every tensor's type is the one llama-quant.cpp's rules give
  (written out here from llama.cpp's use_more_bits, not asked of helmc's QuantMix that make_gguf uses); gguf's own
  dequantization gives finite weights of std ~0.02 and mean ~0.
- The same seed writes the same bytes; another seed other bytes.
- gemma3's file: tied (no output.weight, token_embd typed as the head), the extra norms, its metadata.
- The Qwen3 Q5_K_M file builds into a bundle and runs: finite logits, 16 greedy tokens; the Gemma 3 Q4_K_M file too
  once helmc reads gemma3 GGUF files (skipped until then).
- llamacpp_peer.ngl_search over a VRAM curve: the largest -ngl that fits, the one above, the one below, then 99.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from benchmarks.llamacpp_peer import ngl_search  # noqa: E402
from benchmarks.make_gguf import make_gguf  # noqa: E402

# Whole K-quant blocks in every row; 9 blocks: llama.cpp's more-bits blocks are 0, 3, 6, 7 and 8.
TINY = dict(hidden=256, ffn=512, heads=2, kv_heads=1, head_dim=128, layers=9, vocab=512)
MORE_BITS = {0, 3, 6, 7, 8}


def more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def expected_type(name: str, base: str, head: str, tied: bool) -> str:
    if name.endswith("norm.weight"):
        return "f32"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return head
    if name.startswith("blk."):
        i, role = int(name.split(".")[1]), name.split(".")[2]
        if role in ("attn_v", "ffn_down") and more_bits(i, TINY["layers"]):
            return "q6_k"
    return base


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for config, mix in (("qwen3-8b", "q5_k_m"), ("gemma3-12b", "q4_k_m")):
        path = str(d / f"{config}-{mix}.gguf")
        make_gguf(path, config, mix, seed=7, **TINY)
        out[config] = path
    return out


@pytest.mark.parametrize("config,base,tied", [("qwen3-8b", "q5_k", False), ("gemma3-12b", "q4_k", True)])
def test_types_are_the_mix_and_weights_are_sane(files, config, base, tied):
    r = gguf.GGUFReader(files[config])
    assert {i for i in range(TINY["layers"]) if more_bits(i, TINY["layers"])} == MORE_BITS
    names = [t.name for t in r.tensors]
    assert ("output.weight" in names) != tied
    assert len(names) == len(set(names))
    for t in r.tensors:
        want = expected_type(t.name, base, "q6_k", tied)
        assert t.tensor_type.name.lower() == want, t.name
        w = gguf.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if want == "f32":
            assert (w == 1).all(), t.name
        else:
            assert 0.017 < w.std() < 0.023 and abs(w.mean()) < 2e-3, (t.name, w.std(), w.mean())
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}    # GGUF order: (cols, rows)
    q = TINY["heads"] * TINY["head_dim"]
    assert shapes["blk.0.attn_q.weight"] == (TINY["hidden"], q)
    assert shapes["blk.0.ffn_down.weight"] == (TINY["ffn"], TINY["hidden"])
    assert shapes["token_embd.weight"] == (TINY["hidden"], TINY["vocab"])


def field(r, key):
    f = r.fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()


def test_gemma3_metadata_and_norms(files):
    r = gguf.GGUFReader(files["gemma3-12b"])
    assert field(r, "general.architecture") == "gemma3"
    assert field(r, "gemma3.attention.sliding_window") == 1024
    assert field(r, "gemma3.rope.freq_base") == 1e6
    assert field(r, "gemma3.rope.scaling.factor") == 8.0
    assert field(r, "gemma3.attention.key_length") == 128      # TINY's head_dim, not hidden / heads
    assert field(r, "general.file_type") == 15                 # LLAMA_FTYPE_MOSTLY_Q4_K_M
    names = {t.name for t in r.tensors}
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.8.attn_q_norm.weight"} <= names


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_same_seed_same_bytes(files, tmp_path):
    again, other = str(tmp_path / "again.gguf"), str(tmp_path / "other.gguf")
    make_gguf(again, "qwen3-8b", "q5_k_m", seed=7, **TINY)
    make_gguf(other, "qwen3-8b", "q5_k_m", seed=8, **TINY)
    assert file_digest(again) == file_digest(files["qwen3-8b"]) != file_digest(other)


def test_unknown_mix_or_config_is_refused(tmp_path):
    from helmc.errors import HelmcError
    with pytest.raises(HelmcError, match="q5_k_m"):
        make_gguf(str(tmp_path / "x.gguf"), "qwen3-8b", "q5_k_x", **TINY)
    with pytest.raises(SystemExit, match="qwen3-8b"):
        make_gguf(str(tmp_path / "x.gguf"), "qwen9", "q5_k_m", **TINY)


@pytest.mark.parametrize("config", ["qwen3-8b", "gemma3-12b"])
def test_file_builds_and_runs(files, host_hardware, cache_dir, tmp_path, config):
    pytest.importorskip("tvm.relax")
    import dataclasses

    from benchmarks.greedy_trace import greedy_trace
    from helmc import api
    from helmc.model.arch import GGUF_ARCHITECTURES
    from helmc.runtime.session import Session
    arch = {"qwen3-8b": "qwen3", "gemma3-12b": "gemma3"}[config]
    if arch not in GGUF_ARCHITECTURES:
        pytest.skip(f"helmc reads no {arch} GGUF file yet (no entry of helmc.model.arch reads it)")
    hw = dataclasses.replace(host_hardware, gpu=None, link=None)
    bundle = api.build(files[config], hw, str(tmp_path / "b"), cache_dir=cache_dir, quiet=True).bundle_dir
    s = Session.load(bundle)
    logits = s.forward(list(range(3, 19)))
    assert logits.shape[-1] == TINY["vocab"] and np.isfinite(logits).all() and logits.std() > 0
    trace = greedy_trace(s, list(range(3, 19)), 16)
    assert len(trace.tokens) == 16 and np.isfinite(trace.top).all()
    r = s.generate(prompt_ids=list(range(3, 19)), max_new_tokens=16, stop_at_eos=False)
    assert list(r.tokens) == list(trace.tokens)


def test_ngl_search_finds_the_largest_that_fits():
    """A VRAM curve of 1.4 GiB + 0.25 GiB a block: in 4 GiB 10 blocks fit, 11 do not; in 3 GiB 6 fit, 7 do not."""
    runs = []

    def run(ngl):
        runs.append(ngl)
        blocks = min(ngl, 36)
        return {"ngl": ngl, "peak_vram_gib": 1.4 + 0.25 * blocks + 0.001, "decode_tok_s_p50": 10 + blocks}
    # first guess: (4 - 1.6) / 0.25 = 9 blocks
    list(ngl_search(run, 4.0, 36, int(36 * 0.25 * 2**30)))
    assert runs == [9, 10, 11, 99]
    runs.clear()
    list(ngl_search(run, 3.0, 36, int(36 * 0.125 * 2**30)))    # a guess of 11 blocks: down to 6, then 5 and 99
    assert runs == [11, 10, 9, 8, 7, 6, 5, 99]


def test_cli_refuses_an_unknown_mix_in_one_line(tmp_path, capsys):
    from benchmarks.make_gguf import main
    assert main([str(tmp_path / "x.gguf"), "--config", "qwen3-8b", "--mix", "q5_k_z"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q5_k_m" in err[0] and "'q5_k_z'" in err[0]
    assert not (tmp_path / "x.gguf").exists()
