"""helmc.compiler.quantize_checkpoint: tiny HF models (qwen3, qwen2, llama) -> GGUF, read back with gguf's reader.

The tiny models are 256 wide (ffn 512, head_dim 64) so that every linear is a whole number of q4_k blocks.
Checked once against llama.cpp 0c1e570 during development (not repeated here: it needs a llama.cpp build):
- its convert_hf_to_gguf.py --outtype q8_0 on the same three models wrote the same keys (less
  general.size_label; plus key/value_length here for qwen2) and byte-identical tensors, the llama q/k
  permutation included, except token_embd (Q8_0 there, F16 here) and qwen3's output.weight (tied: absent there);
- llama-quantize --pure Q4_K_S (native build) of its f32 file gave Q4_K blocks 100% identical to these;
- libllama loaded every file; q8_0 last-token logits of an 8-token prompt were within 2.9-3.9% of
  transformers' fp32 logits, and 106% off for a llama file written without the q/k permutation.
"""
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")   # the GPU machine runs pytest -m gpu without it

import helmc.compiler.quantize_checkpoint as qc  # noqa: E402
from helmc.errors import HelmcError  # noqa: E402
from helmc.model.quant_formats import dequantize, quantize  # noqa: E402
from helmc.testing import make_tiny_model  # noqa: E402

DIMS = dict(hidden_size=256, intermediate_size=512, head_dim=64)
QUANTS = ("q8_0", "q4_0", "q4_k")
# Relative RMS error of a linear's dequantized weights (Gaussian weights; quant_formats' docstring measures
# 0.0054 / 0.0860 / 0.0713 on 1M weights), with room for the tiny tensors' sampling noise.
REL_RMS = {"q8_0": 0.007, "q4_0": 0.10, "q4_k": 0.085}
LINEARS = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
           "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate",
           "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
OTHERS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias"}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (model dir, {HF name: float32 weights as saved})."""
    out = {}
    for arch in ("qwen3", "qwen2", "llama"):
        d = str(tmp_path_factory.mktemp(arch))
        m = make_tiny_model(d, arch, **DIMS)
        out[arch] = (d, {k: v.float().numpy() for k, v in m.state_dict().items()})
    with open(os.path.join(out["qwen3"][0], "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)
    return out


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's LlamaModel.permute, written as it is there (reshape, swap, reshape)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_tensors(arch, weights):
    """GGUF name -> (HF weights in GGUF row order, kind) for a tiny model."""
    heads, kv_heads = 4, 2
    exp = {"token_embd.weight": (weights["model.embed_tokens.weight"], "embd"),
           "output_norm.weight": (weights["model.norm.weight"], "f32"),
           "output.weight": (weights.get("lm_head.weight", weights["model.embed_tokens.weight"]), "linear")}
    for i in range(2):
        for hf, g in {**LINEARS, **OTHERS}.items():
            name = f"model.layers.{i}.{hf}"
            if name not in weights:
                continue
            w = weights[name]
            if arch == "llama" and g in ("attn_q", "attn_k"):
                w = llama_permute(w, heads if g == "attn_q" else kv_heads)
            gname = f"blk.{i}.{g}" + ("" if g.endswith(".bias") else ".weight")
            exp[gname] = (w, "linear" if hf in LINEARS else "f32")
    return exp


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tensors_names_types_shapes_values(models, tmp_path, arch, quant):
    model_dir, weights = models[arch]
    path = qc.quantize_checkpoint(model_dir, quant, str(tmp_path / "cache"))
    r = gguf.GGUFReader(path)
    got = {t.name: t for t in r.tensors}
    exp = expected_tensors(arch, weights)
    assert set(got) == set(exp)
    qtype = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}[quant]
    for name, (w, kind) in exp.items():
        t = got[name]
        assert [int(d) for d in reversed(t.shape)] == list(w.shape), name          # GGUF lists ne0 (k) first
        assert t.tensor_type.name == {"linear": qtype, "embd": "F16", "f32": "F32"}[kind], name
        if kind == "linear":
            y = dequantize(np.asarray(t.data), quant, w.shape)
            assert rel_rms(y, w) < REL_RMS[quant], (name, rel_rms(y, w))
            assert np.array_equal(np.asarray(t.data).reshape(w.shape[0], -1), quantize(w, quant)), name
        elif kind == "embd":
            assert np.array_equal(np.asarray(t.data), w.astype(np.float16))
        else:
            assert np.array_equal(np.asarray(t.data), w)


def field(r, key):
    return r.fields[key].contents()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_metadata_as_llama_cpp_converter_writes_it(models, tmp_path, arch):
    model_dir, _ = models[arch]
    r = gguf.GGUFReader(qc.quantize_checkpoint(model_dir, "q8_0", str(tmp_path)))
    a = field(r, "general.architecture")
    assert a == arch
    expect = {f"{a}.block_count": 2, f"{a}.context_length": 512, f"{a}.embedding_length": 256,
              f"{a}.feed_forward_length": 512, f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 2,
              f"{a}.attention.key_length": 64, f"{a}.attention.value_length": 64,
              "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0), "tokenizer.ggml.model": "gpt2",
              "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    for k, v in expect.items():
        assert field(r, k) == v, k
    assert field(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert field(r, f"{a}.rope.freq_base") == (10000.0 if arch == "llama" else 1e6)
    assert field(r, "tokenizer.ggml.pre") == "gpt-2"          # the tiny tokenizer: a bare ByteLevel, GPT-2's regex
    tokens = field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == 512 and len(field(r, "tokenizer.ggml.token_type")) == 512
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    assert tokens[tok["model"]["vocab"]["Ġthe"]] == "Ġthe"
    assert len(field(r, "tokenizer.ggml.merges")) == len(tok["model"]["merges"])
    if arch == "llama":
        assert field(r, "llama.vocab_size") == 512 and field(r, "llama.rope.dimension_count") == 64
    if arch == "qwen3":
        assert field(r, "tokenizer.chat_template") == CHAT_TEMPLATE


def test_second_call_is_a_cache_hit_that_does_no_work(models, tmp_path, monkeypatch):
    model_dir, _ = models["qwen3"]
    cache = str(tmp_path / "cache")
    said = []
    first = qc.quantize_checkpoint(model_dir, "q4_k", cache, progress=said.append)
    stat = os.stat(first)
    assert any("wrote" in m for m in said) and not any("cached" in m for m in said)

    def no_work(*a, **k):
        raise AssertionError("a cache hit must not quantize")
    monkeypatch.setattr(qc, "quantize", no_work)
    said.clear()
    second = qc.quantize_checkpoint(model_dir, "q4_k", cache, progress=said.append)
    assert second == first and os.stat(second).st_mtime_ns == stat.st_mtime_ns
    assert len(said) == 1 and "cached" in said[0]
    assert sorted(os.listdir(cache)) == [os.path.basename(first)]            # no temporary file left behind
    monkeypatch.undo()
    assert qc.quantize_checkpoint(model_dir, "q8_0", cache) != first          # the type is part of the key


def test_a_changed_config_is_a_new_file(tmp_path):
    d = str(tmp_path / "m")
    make_tiny_model(d, "qwen2", **DIMS)
    first = qc.quantize_checkpoint(d, "q8_0", str(tmp_path / "cache"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["rms_norm_eps"] = 1e-5
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    second = qc.quantize_checkpoint(d, "q8_0", str(tmp_path / "cache"))
    assert second != first and field(gguf.GGUFReader(second), "qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)


def test_a_bad_quant_name_is_refused_before_anything_is_written(models, tmp_path):
    cache = tmp_path / "never"
    with pytest.raises(HelmcError, match=r"q8_0, q4_0, q3_k.*'q2_k'"):
        qc.quantize_checkpoint(models["qwen3"][0], "q2_k", str(cache))
    assert not cache.exists()


def test_rows_not_a_whole_number_of_q4_k_blocks_fall_back_to_q8_0(tmp_path):
    """The default tiny dims (hidden 64, ffn 160) fit no q4_k block: every linear is written q8_0, and
    progress says so."""
    d = str(tmp_path / "m")
    make_tiny_model(d, "qwen3")
    said = []
    r = gguf.GGUFReader(qc.quantize_checkpoint(d, "q4_k", str(tmp_path / "cache"), progress=said.append))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == types["output.weight"] == "Q8_0"
    assert any("blk.0.attn_q" not in m and "model.layers.0.self_attn.q_proj.weight [128, 64]: 64 is not a multiple"
               in m and m.endswith("written as q8_0") for m in said), said


def test_bf16_checkpoint(tmp_path):
    d = str(tmp_path / "m")
    m = make_tiny_model(d, "llama", dtype="bfloat16", **DIMS)
    w = {k: v.float().numpy() for k, v in m.state_dict().items()}
    r = gguf.GGUFReader(qc.quantize_checkpoint(d, "q8_0", str(tmp_path / "cache")))
    got = {t.name: t for t in r.tensors}
    down = w["model.layers.1.mlp.down_proj.weight"]
    y = dequantize(np.asarray(got["blk.1.ffn_down.weight"].data), "q8_0", down.shape)
    assert rel_rms(y, down) < REL_RMS["q8_0"]
    q = llama_permute(w["model.layers.0.self_attn.q_proj.weight"], 4)
    assert np.array_equal(np.asarray(got["blk.0.attn_q.weight"].data).reshape(q.shape[0], -1), quantize(q, "q8_0"))
    # bf16 bits -> float32 is exact, then rounded to f16 (only values under f16's normal range, 6.1e-5, lose bits)
    assert np.array_equal(np.asarray(got["token_embd.weight"].data), w["model.embed_tokens.weight"].astype(np.float16))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_helmc_gguf_reader_reads_back_the_spec_and_tokenizer(models, tmp_path, arch):
    """gguf_spec (helmc's GGUF reader) derives the checkpoint's ModelSpec from the file, but for the dtype
    (the embedding's, F16) and, for tied qwen3, tie_word_embeddings (output.weight is now a tensor of its
    own), and rebuilds a tokenizer that encodes as the original."""
    import dataclasses

    from tokenizers import Tokenizer

    from helmc.model.gguf_spec import read_gguf_spec
    from helmc.model.gguf_tokenizer import read_gguf_tokenizer
    from helmc.model.spec import ModelSpec

    model_dir, _ = models[arch]
    path = qc.quantize_checkpoint(model_dir, "q4_k", str(tmp_path))
    want = ModelSpec.from_model_dir(model_dir)
    want = dataclasses.replace(want, dtype="float16", tie_word_embeddings=False)
    assert read_gguf_spec(path) == want
    text = "The quick brown fox jumps over the lazy dog. Hello world!  123 <|endoftext|> ok"
    rebuilt = Tokenizer.from_str(read_gguf_tokenizer(path)[0])
    assert rebuilt.encode(text).ids == Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids
