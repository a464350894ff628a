"""GGUF as a model input: tiny files written here with gguf.GGUFWriter as llama.cpp's converter writes them
(random weights of Qwen3 / Qwen2 / Llama shapes), read back through helmc.model.gguf_spec and
helmc.runtime.weights.gguf_mmap, and compared with what the Hugging Face side gives for the same model."""
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import TokenType  # noqa: E402

from helmc.errors import HelmcError  # noqa: E402
from helmc.model.gguf_spec import (expected_hf_tensors, gguf_name, gguf_tensor_types, hf_name,  # noqa: E402
                                   qk_rows_to_gguf, qk_rows_to_hf, read_gguf_spec)
from helmc.model.gguf_tokenizer import read_gguf_tokenizer  # noqa: E402
from helmc.model.quant_formats import dequantize  # noqa: E402
from helmc.model.spec import ModelSpec  # noqa: E402
from helmc.runtime.weights.bind import expected_tensors  # noqa: E402
from helmc.runtime.weights.gguf_mmap import GGUFCheckpoint  # noqa: E402

GGUF_ARCH = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


def hf_config(arch: str, dtype: str = "float16", **over) -> dict:
    """config.json of a tiny model as transformers writes it."""
    from helmc.testing import tiny_config
    cfg = tiny_config(arch, num_layers=2, head_dim=32, dtype=dtype, **over)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg.to_dict()


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute (convert_hf_to_gguf), on NumPy: each head's rows, halves interleaved
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype) -> np.ndarray:
    """uint8 [rows, row_bytes] of float32 w [rows, cols] (1-D: one row) as GGUF stores it."""
    w2 = w.reshape(1, -1) if w.ndim == 1 else w
    if qtype == T.F32:
        return w2.astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return w2.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(w2, qtype)


def write_gguf(path, spec: ModelSpec, types=None, seed=0, arch=None, tokenizer=None, extra=None,
               drop=(), reshape=None, raw_override=None, meta=None):
    """Write a GGUF of random weights for `spec`. Returns {HF name: float32 weights in HF order} and
    {GGUF name: the uint8 bytes written}. types: {HF suffix: GGML type} for 2-D weights (default F16);
    1-D tensors are F32 as llama.cpp keeps them."""
    rng = np.random.default_rng(seed)
    arch = arch or GGUF_ARCH[spec.architecture]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    if spec.rope.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope.factor)
    w.add_bos_token_id(spec.bos_token_id)
    w.add_eos_token_id(spec.eos_token_ids[0])
    for key, value in (meta or {}).items():
        w.add_key_value(key, value[0], value[1])
    if tokenizer is not None:
        tokenizer(w)
    originals, written = {}, {}
    for hf, shape in expected_tensors(spec).items():
        g = gguf_name(hf)
        if g in drop:
            continue
        shape = (reshape or {}).get(g, shape)
        x = (1 + 0.1 * rng.standard_normal(shape) if "norm" in hf else 0.08 * rng.standard_normal(shape)).astype(np.float32)
        originals[hf] = x
        stored = x
        if spec.architecture == "LlamaForCausalLM" and g.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            stored = converter_permute(x, spec.num_heads if ".attn_q." in g else spec.num_kv_heads)
        suffix = hf.split(".", 3)[-1] if hf.startswith("model.layers.") else hf
        qtype = T.F32 if x.ndim == 1 else (types or {}).get(suffix, T.F16)
        data = (raw_override or {}).get(g)
        if data is None:
            data = encode(stored, qtype)
        else:
            qtype, data = data
        written[g] = data
        if x.ndim == 1:               # 1-D: written as a 1-D F32 array (bytes [1, n] would make it 2-D)
            w.add_tensor(g, stored)
        else:                         # the writer turns the byte shape [rows, row_bytes] into [rows, cols]
            w.add_tensor(g, data, raw_dtype=qtype)
    for name, x in (extra or {}).items():      # tensors beyond the HF ones: rope_freqs, or unexpected ones
        w.add_tensor(name, np.asarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals, written


def spec_of(arch: str, **over) -> ModelSpec:
    return ModelSpec.from_hf_config(hf_config(arch, **over))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_spec_equals_the_hf_config_spec(tmp_path, arch):
    expect = spec_of(arch)
    write_gguf(tmp_path / "m.gguf", expect)
    assert read_gguf_spec(str(tmp_path / "m.gguf")) == expect
    assert expected_hf_tensors(expect) == expected_tensors(expect)    # the model layer's copy of bind's table
    # tied (qwen3's tiny default) <-> no output.weight; qwen2's q/k/v bias <-> blk.0.attn_q.bias
    assert expect.tie_word_embeddings == (arch == "qwen3") and expect.qkv_bias == (arch == "qwen2")


def test_llama3_and_linear_rope(tmp_path):
    base = dict(max_position_embeddings=16384, rope_theta=500000.0)
    for low, high, old in ((1.0, 8.0, 4096), (1.0, 4.0, 8192)):       # a line fit, then Llama 3.1's values
        params = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=low,
                      high_freq_factor=high, original_max_position_embeddings=old)
        expect = ModelSpec.from_hf_config(dict(hf_config("llama", **base), rope_parameters=params))
        assert expect.rope.kind == "llama3"
        freq = 500000.0 ** (-np.arange(0, 32, 2) / 32)                   # convert_hf_to_gguf's rope_factors
        wavelen = 2 * np.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
        write_gguf(tmp_path / "l3.gguf", expect, extra={"rope_freqs.weight": factors})
        assert read_gguf_spec(str(tmp_path / "l3.gguf")) == expect
    linear = ModelSpec.from_hf_config(dict(hf_config("llama"), rope_parameters=dict(rope_type="linear", factor=2.0,
                                                                                     rope_theta=10000.0)))
    write_gguf(tmp_path / "lin.gguf", linear)
    assert read_gguf_spec(str(tmp_path / "lin.gguf")).rope == linear.rope and linear.rope.kind == "linear"


def test_dtype_follows_the_token_embedding(tmp_path):
    spec = spec_of("qwen3")
    for qtype, dtype in ((T.F32, "float32"), (T.BF16, "bfloat16"), (T.Q8_0, "float16")):
        write_gguf(tmp_path / "d.gguf", spec, types={"model.embed_tokens.weight": qtype})
        assert read_gguf_spec(str(tmp_path / "d.gguf")).dtype == dtype


MIXED = {"self_attn.q_proj.weight": T.Q8_0, "self_attn.k_proj.weight": T.Q8_0, "self_attn.v_proj.weight": T.Q4_0,
         "self_attn.o_proj.weight": T.Q8_0, "mlp.gate_proj.weight": T.Q4_0, "mlp.up_proj.weight": T.Q4_0,
         "mlp.down_proj.weight": T.Q8_0, "model.embed_tokens.weight": T.F16, "lm_head.weight": T.BF16}


def test_tensor_types_and_names(tmp_path):
    spec = spec_of("qwen2")
    write_gguf(tmp_path / "m.gguf", spec, types=MIXED)
    types = gguf_tensor_types(str(tmp_path / "m.gguf"))
    assert set(types) == set(expected_tensors(spec))
    for name, t in types.items():
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        want = "f32" if len(expected_tensors(spec)[name]) == 1 else MIXED.get(suffix, T.F16).name.lower()
        assert t == want, name
        assert hf_name(gguf_name(name)) == name
    assert gguf_name("model.layers.7.self_attn.k_norm.weight") == "blk.7.attn_k_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(HelmcError, match="blk.0.ffn_gate_exps.weight"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_raw_is_a_view_of_the_written_bytes_and_dequantizes(tmp_path):
    spec = spec_of("qwen2")
    originals, written = write_gguf(tmp_path / "m.gguf", spec, types=MIXED)
    ck = GGUFCheckpoint(str(tmp_path / "m.gguf"))
    try:
        for name, x in originals.items():
            g = gguf_name(name)
            raw, info = ck.raw(name), ck.info(name)
            assert raw.dtype == np.uint8 and raw.shape == written[g].shape, name
            assert np.array_equal(raw, written[g]), name
            # a window on the read-only mapping: not a copy (a copy would own its data and be writeable)
            assert not raw.flags.owndata and not raw.flags.writeable and np.shares_memory(raw, ck.raw(name))
            assert info.shape == x.shape and info.nbytes == raw.size and info.gguf_name == g
            assert ck.hf_row_order(name) is None and ck.raw_hf(name) is not None
            qtype = T[info.type.upper()]
            back = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
            rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2))
            assert rel < {"q8_0": 0.01, "q4_0": 0.15, "bf16": 0.005, "f16": 0.001, "f32": 1e-7}[info.type], (name, rel)
        q = "model.layers.0.self_attn.q_proj.bias"
        assert np.array_equal(ck.view(q, (spec.q_dim,)), originals[q])
        lm = ck.view("lm_head.weight")                                   # bf16 as its uint16 bits
        assert lm.dtype == np.uint16 and ck.info("lm_head.weight").dtype == "bfloat16"
        assert np.allclose((lm.astype(np.uint32) << 16).view(np.float32), originals["lm_head.weight"], atol=2e-3)
        with pytest.raises(HelmcError, match="q8_0"):
            ck.view("model.layers.0.self_attn.q_proj.weight")
        with pytest.raises(HelmcError, match=r"shape expected \[9, 9\]"):
            ck.view("model.norm.weight", (9, 9))
    finally:
        ck.close()


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0], ids=["f16", "q8_0"])
def test_llama_q_k_rows_come_back_in_hf_order(tmp_path, qtype):
    spec = spec_of("llama", attention_bias=True)
    assert spec.qkv_bias and spec.num_heads != spec.num_kv_heads
    types = {"self_attn.q_proj.weight": qtype, "self_attn.k_proj.weight": qtype}
    originals, written = write_gguf(tmp_path / "l.gguf", spec, types=types)
    ck = GGUFCheckpoint(str(tmp_path / "l.gguf"))
    try:
        for i in range(spec.num_layers):
            for proj in ("q_proj", "k_proj"):
                w, b = f"model.layers.{i}.self_attn.{proj}.weight", f"model.layers.{i}.self_attn.{proj}.bias"
                assert not np.array_equal(ck.raw(w), encode(originals[w], qtype))    # the file's order differs
                assert np.array_equal(ck.raw_hf(w), encode(originals[w], qtype))    # whole rows, any type
                assert np.array_equal(ck.raw(w)[ck.hf_row_order(w)], ck.raw_hf(w))
                assert np.array_equal(ck.view(b), originals[b])                     # biases are permuted too
                assert np.array_equal(ck.raw_hf(b).view(np.float32).reshape(-1), originals[b])
                if qtype == T.F16:
                    assert np.array_equal(ck.view(w), originals[w].astype(np.float16))
            v = f"model.layers.{i}.self_attn.v_proj.weight"                          # v and the rest: as written
            assert ck.hf_row_order(v) is None and np.array_equal(ck.view(v), originals[v].astype(np.float16))
    finally:
        ck.close()
    x = np.random.default_rng(2).standard_normal((spec.kv_dim, 3))
    order = qk_rows_to_gguf(spec.num_kv_heads, spec.head_dim)              # what a HF -> GGUF writer applies
    assert np.array_equal(x[order], converter_permute(x, spec.num_kv_heads))
    assert np.array_equal(x[order][qk_rows_to_hf(spec.num_kv_heads, spec.head_dim)], x)
    qwen = spec_of("qwen3")
    write_gguf(tmp_path / "q.gguf", qwen)
    ck = GGUFCheckpoint(str(tmp_path / "q.gguf"))
    assert ck.hf_row_order("model.layers.0.self_attn.q_proj.weight") is None    # qwen files are not permuted
    ck.close()


def test_k_quants_and_bf16_rows(tmp_path):
    # Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS blocks hold 256 weights, so rows of 256 (Q5_0: 32): random blocks (raw bytes are what is checked)
    spec = spec_of("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    rng = np.random.default_rng(1)
    raw = {}
    for g, qtype, (rows, cols) in (("blk.0.ffn_up.weight", T.Q4_K, (512, 256)), ("blk.1.ffn_down.weight", T.Q6_K, (256, 512)),
                                   ("blk.1.ffn_gate.weight", T.Q5_K, (512, 256)),
                                   ("blk.0.ffn_gate.weight", T.Q3_K, (512, 256)),
                                   ("blk.0.ffn_down.weight", T.Q5_0, (256, 512)),
                                   ("blk.1.ffn_up.weight", T.IQ4_XS, (512, 256)),
                                   ("blk.1.attn_output.weight", T.MXFP4, (256, 256))):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw[g] = (qtype, rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8))
    iq4 = raw["blk.1.ffn_up.weight"][1].reshape(512, -1, 136)          # [rows, blocks, 136]: d finite
    iq4[:, :, 0:2] = rng.uniform(-1e-2, 1e-2, iq4.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    raw["blk.1.attn_output.weight"][1].reshape(256, -1, 17)[:, :, 0] = rng.integers(100, 140, (256, 8))   # e8m0
    _, written = write_gguf(tmp_path / "k.gguf", spec, raw_override=raw)
    types = gguf_tensor_types(str(tmp_path / "k.gguf"))
    assert types["model.layers.0.mlp.up_proj.weight"] == "q4_k" and types["model.layers.1.mlp.down_proj.weight"] == "q6_k"
    ck = GGUFCheckpoint(str(tmp_path / "k.gguf"))
    assert np.array_equal(ck.raw("model.layers.0.mlp.up_proj.weight"), raw["blk.0.ffn_up.weight"][1])
    assert ck.info("model.layers.1.mlp.down_proj.weight").row_bytes == 2 * 210
    assert types["model.layers.1.mlp.gate_proj.weight"] == "q5_k"
    assert ck.info("model.layers.1.mlp.gate_proj.weight").row_bytes == 176
    assert np.array_equal(ck.raw("model.layers.1.mlp.gate_proj.weight"), raw["blk.1.ffn_gate.weight"][1])
    assert types["model.layers.0.mlp.gate_proj.weight"] == "q3_k"
    assert ck.info("model.layers.0.mlp.gate_proj.weight").row_bytes == 110
    assert np.array_equal(ck.raw("model.layers.0.mlp.gate_proj.weight"), raw["blk.0.ffn_gate.weight"][1])
    assert types["model.layers.0.mlp.down_proj.weight"] == "q5_0"
    assert ck.info("model.layers.0.mlp.down_proj.weight").row_bytes == 16 * 22
    assert np.array_equal(ck.raw("model.layers.0.mlp.down_proj.weight"), raw["blk.0.ffn_down.weight"][1])
    assert types["model.layers.1.mlp.up_proj.weight"] == "iq4_xs"
    assert ck.info("model.layers.1.mlp.up_proj.weight").row_bytes == 136
    iq4 = ck.raw("model.layers.1.mlp.up_proj.weight")
    assert np.array_equal(iq4, raw["blk.1.ffn_up.weight"][1])
    assert np.array_equal(dequantize(iq4, "iq4_xs", (512, 256)),
                          gguf.quants.dequantize(raw["blk.1.ffn_up.weight"][1], T.IQ4_XS).reshape(512, 256))
    assert types["model.layers.1.self_attn.o_proj.weight"] == "mxfp4"
    assert ck.info("model.layers.1.self_attn.o_proj.weight").row_bytes == 8 * 17
    fp4 = ck.raw("model.layers.1.self_attn.o_proj.weight")
    assert np.array_equal(fp4, raw["blk.1.attn_output.weight"][1])
    assert np.array_equal(dequantize(fp4, "mxfp4", (256, 256)),
                          gguf.quants.dequantize(raw["blk.1.attn_output.weight"][1], T.MXFP4).reshape(256, 256))
    ck.close()


# ---- the tokenizer ----------------------------------------------------------------------------------
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")                                       # Qwen2's tokenizer.json
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")                                      # Llama 3's
CORPUS = ("The quick brown fox jumps over the lazy dog. I've been told he's there, we'll see. 12345 + 678 = 13023.\n"
          "Café, naïve, 中文字符, emoji 🦙🚀. def main():\n    return 42\n\n") * 8
SAMPLES = ["Hello world! I've been told he's THERE.", "  leading spaces\n\n\ttabs   and\r\nnewlines ",
           "numbers 1234567 and 3.14159", "café vs cafe\u0301 (NFC)", "emoji 🦙🚀 and 中文 mixed",
           "<|im_start|>user\nhi<think>plan</think><|im_end|>", "unseen: Zyxwvut ØÆ ß", "a zebra", ""]


def source_tokenizer(style: str):
    """A byte-level BPE as the model's tokenizer.json defines it, trained on CORPUS."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX if style == "qwen2" else LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if style == "qwen2" else ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if style == "llama-bpe":        # Llama 3: ignore_merges, and BOS prepended by the post-processor
        model = json.loads(tok.to_str())["model"]
        vocab = dict(model["vocab"], **{"Ġzebra": len(model["vocab"])})   # a word no merge reaches: whole, by ignore_merges
        tok.model = models.BPE(vocab, [tuple(m) for m in model["merges"]], ignore_merges=True)
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False), AddedToken("</think>", special=False, normalized=False)])
    return tok


def gguf_vocab(tok, vocab_size: int, pre: str, template: str | None = None):
    """A writer hook putting `tok` into tokenizer.ggml.* keys as llama.cpp's converter does."""
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(TokenType.NORMAL if i not in added else TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]

    def hook(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        if template:
            w.add_chat_template(template)
    return hook


@pytest.mark.parametrize("style", ["qwen2", "llama-bpe"])
def test_tokenizer_gives_the_same_ids(tmp_path, style):
    from tokenizers import Tokenizer
    src = source_tokenizer(style)
    spec = spec_of("qwen2" if style == "qwen2" else "llama")
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    write_gguf(tmp_path / "t.gguf", spec, tokenizer=gguf_vocab(src, spec.vocab_size, style, template))
    text, chat = read_gguf_tokenizer(str(tmp_path / "t.gguf"))
    tok = Tokenizer.from_str(text)
    assert chat == template
    for s in SAMPLES:
        ids = tok.encode(s).ids
        assert ids == src.encode(s).ids, s
        assert tok.decode(ids) == src.decode(ids)
    assert tok.encode("x").ids[0] == (0 if style == "llama-bpe" else tok.token_to_id("x"))   # BOS only for llama-bpe
    assert tok.encode("<think>").ids[-1] == src.token_to_id("<think>")
    assert read_gguf_spec(str(tmp_path / "t.gguf")).vocab_size == spec.vocab_size


def test_tokenizer_refusals(tmp_path):
    src = source_tokenizer("qwen2")
    spec = spec_of("qwen2")
    write_gguf(tmp_path / "p.gguf", spec, tokenizer=gguf_vocab(src, spec.vocab_size, "deepseek-coder"))
    with pytest.raises(HelmcError, match="tokenizer.ggml.pre expected one of .*found 'deepseek-coder'"):
        read_gguf_tokenizer(str(tmp_path / "p.gguf"))
    write_gguf(tmp_path / "s.gguf", spec, meta={"tokenizer.ggml.model": ("llama", gguf.GGUFValueType.STRING)})
    with pytest.raises(HelmcError, match="SentencePiece"):
        read_gguf_tokenizer(str(tmp_path / "s.gguf"))
    write_gguf(tmp_path / "n.gguf", spec)
    with pytest.raises(HelmcError, match="no tokenizer"):
        read_gguf_tokenizer(str(tmp_path / "n.gguf"))


# ---- bad inputs -------------------------------------------------------------------------------------
def both_readers_fail(path, *patterns):
    for read in (read_gguf_spec, GGUFCheckpoint):
        with pytest.raises(HelmcError) as e:
            read(str(path))
        for p in patterns:
            assert p in str(e.value), (read.__name__, str(e.value))


def test_bad_magic_and_truncation(tmp_path):
    spec = spec_of("qwen3")
    p = tmp_path / "m.gguf"
    write_gguf(p, spec)
    data = p.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    both_readers_fail(tmp_path / "magic.gguf", "not a GGUF file", "b'GGUF'", "b'GGML'")
    (tmp_path / "cut.gguf").write_bytes(data[:-40])          # past the last tensor's alignment padding
    both_readers_fail(tmp_path / "cut.gguf", "truncated", "past the end of the file", str(len(data) - 40))
    (tmp_path / "head.gguf").write_bytes(data[:300])          # cut inside the key/value section
    both_readers_fail(tmp_path / "head.gguf", "truncated or corrupt")
    (tmp_path / "empty.gguf").write_bytes(b"")
    both_readers_fail(tmp_path / "empty.gguf", "not a GGUF file")


def test_unknown_architecture(tmp_path):
    write_gguf(tmp_path / "g.gguf", spec_of("qwen3"), arch="gemma2")
    both_readers_fail(tmp_path / "g.gguf", "general.architecture expected one of qwen3, qwen2, llama", "'gemma2'")


def test_unsupported_type_names_the_tensor(tmp_path):
    spec = spec_of("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    block, size = gguf.GGML_QUANT_SIZES[T.Q2_K]
    q2 = np.zeros((512, 256 // block * size), dtype=np.uint8)
    write_gguf(tmp_path / "q2.gguf", spec, raw_override={"blk.1.ffn_gate.weight": (T.Q2_K, q2)})
    both_readers_fail(tmp_path / "q2.gguf", "'blk.1.ffn_gate.weight'", "model.layers.1.mlp.gate_proj.weight", "Q2_K")
    with pytest.raises(HelmcError, match="Q2_K"):
        gguf_tensor_types(str(tmp_path / "q2.gguf"))


def test_wrong_shape_and_missing_tensor(tmp_path):
    spec = spec_of("qwen2")
    write_gguf(tmp_path / "s.gguf", spec, reshape={"blk.1.attn_k.weight": (2 * spec.kv_dim, spec.hidden_size)})
    both_readers_fail(tmp_path / "s.gguf", "'blk.1.attn_k.weight'", f"expected GGUF dims [{spec.hidden_size}, {spec.kv_dim}]",
                      f"found dims [{spec.hidden_size}, {2 * spec.kv_dim}]")
    write_gguf(tmp_path / "ok.gguf", spec)
    with pytest.raises(HelmcError, match="intermediate_size 192 expected, 160 in the file"):   # a bundle's own spec
        GGUFCheckpoint(str(tmp_path / "ok.gguf"), spec=spec_of("qwen2", intermediate_size=192))
    GGUFCheckpoint(str(tmp_path / "ok.gguf"), spec=spec).close()
    write_gguf(tmp_path / "m.gguf", spec, drop=("blk.1.ffn_up.weight",))
    both_readers_fail(tmp_path / "m.gguf", "missing tensor 'blk.1.ffn_up.weight'", "model.layers.1.mlp.up_proj.weight")
    write_gguf(tmp_path / "x.gguf", spec, extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 32))})
    both_readers_fail(tmp_path / "x.gguf", "unexpected tensor 'blk.0.ffn_gate_exps.weight'")
    write_gguf(tmp_path / "o.gguf", spec_of("qwen3"), extra={"output.weight": np.zeros((512, 64))})  # qwen3 tiny is tied
    assert read_gguf_spec(str(tmp_path / "o.gguf")).tie_word_embeddings is False
    with pytest.raises(HelmcError, match=r"weights: tensor 'lm_head.weight' expected"):   # tied: no lm_head
        write_gguf(tmp_path / "t.gguf", spec_of("qwen3"))
        GGUFCheckpoint(str(tmp_path / "t.gguf")).info("lm_head.weight")


def test_yarn_rope_as_llama_cpp_writes_it(tmp_path):
    """A Qwen3 config with YaRN (rope_scaling's usual long-context recipe) and the GGUF llama.cpp's converter makes
    of it (scaling type, factor, original context; beta_fast / beta_slow when given) read to the same RopeSpec; an
    attention scale the reader does not follow is refused, and helmc's writer refuses an untruncated YaRN ramp
    (gpt-oss's), which llama.cpp's files cannot say."""
    import dataclasses

    from helmc.compiler.quantize_checkpoint import _add_metadata
    params = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768)
    expect = ModelSpec.from_hf_config(dict(hf_config("qwen3", max_position_embeddings=131072), rope_parameters=params))
    assert expect.rope.kind == "yarn" and expect.rope.truncate and expect.rope.attention_factor > 1.1
    S, F, U = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32
    yarn = {"qwen3.rope.scaling.type": ("yarn", S), "qwen3.rope.scaling.factor": (4.0, F),
            "qwen3.rope.scaling.original_context_length": (32768, U)}
    write_gguf(tmp_path / "y.gguf", expect, meta=yarn)
    assert read_gguf_spec(str(tmp_path / "y.gguf")) == expect
    betas = dict(yarn, **{"qwen3.rope.scaling.yarn_beta_fast": (16.0, F), "qwen3.rope.scaling.yarn_beta_slow": (2.0, F)})
    write_gguf(tmp_path / "b.gguf", expect, meta=betas)
    assert read_gguf_spec(str(tmp_path / "b.gguf")).rope == dataclasses.replace(expect.rope, beta_fast=16.0, beta_slow=2.0)
    write_gguf(tmp_path / "a.gguf", expect, meta=dict(yarn, **{"qwen3.rope.scaling.attn_factor": (0.5, F)}))
    with pytest.raises(HelmcError, match="YaRN RoPE expected llama.cpp's default attention scale, found "
                                         "qwen3.rope.scaling.attn_factor = 0.5"):
        read_gguf_spec(str(tmp_path / "a.gguf"))
    write_gguf(tmp_path / "n.gguf", expect, meta={k: v for k, v in yarn.items() if "original" not in k})
    with pytest.raises(HelmcError, match="required key 'qwen3.rope.scaling.original_context_length' missing"):
        read_gguf_spec(str(tmp_path / "n.gguf"))
    untruncated = dataclasses.replace(expect, rope=dataclasses.replace(expect.rope, truncate=False))
    with pytest.raises(HelmcError, match="GGUF writer: YaRN RoPE expected llama.cpp's .truncated ramp"):
        _add_metadata(gguf.GGUFWriter(str(tmp_path / "w.gguf"), "qwen3"), str(tmp_path), untruncated, "q8_0")
