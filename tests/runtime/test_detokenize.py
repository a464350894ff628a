"""The incremental detokenizer (runtime/detokenize.py) and the stop strings over it (runtime/sampling.StopText):
the streamed chunks put together are the one-shot decode, for characters split over byte-level BPE tokens (CJK,
emoji, joined emoji) and over SentencePiece's byte-fallback tokens, and for arbitrary id sequences; no chunk ends
inside a character; a stop string of any length costs each step about its new text."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from helmc.runtime.detokenize import Detokenizer
from helmc.runtime.sampling import StopText
from helmc.testing import make_tokenizer

TEXTS = ["héllo 世界, 日本語のテキスト", "emoji 🙂🚀 and a family 👩\u200d👩\u200d👧 ok", "naïve café — “quotes” ½ ∑ x²",
         "mixed: ascii then 漢字🙂 then ascii again"]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    """The tiny models' byte-level BPE (GPT-2 / Llama 3 / Qwen style): trained on English, so every CJK character or
    emoji is 3-4 byte tokens."""
    return make_tokenizer(str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def sentencepiece_bpe():
    """A Llama 2 / Mistral style tokenizer: "▁" for spaces, byte-fallback tokens <0xNN> for what the vocabulary lacks,
    and the decoder that strips the first token's leading space (tokenizers' own components, as those models ship)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "d", "e", "h", "i", "l", "m", "n", "o", "r", "s", "t", "x", "é", ":",
                  "▁the", "▁a", "lo", "he", "ll"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def stream(tok, ids):
    d = Detokenizer(tok)
    chunks = [d.add(t) for t in ids]
    return chunks, d.flush()


def splits_a_character(tok, ids) -> bool:
    """Some prefix of ids decodes to text ending in U+FFFD where the whole decode has a real character."""
    full = tok.decode(ids)
    return any((p := tok.decode(ids[:i])).endswith("\ufffd") and not full.startswith(p) for i in range(1, len(ids)))


@pytest.mark.parametrize("which", ["byte_bpe", "sentencepiece_bpe"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_one_shot_decode(request, which, text):
    tok = request.getfixturevalue(which)
    ids = tok.encode(text).ids
    assert splits_a_character(tok, ids)                       # the case at stake: a character over several tokens
    chunks, rest = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) and rest == ""
    assert tok.decode(ids).strip() == text.strip()
    assert not any(c.endswith("\ufffd") for c in chunks)      # a chunk never ends inside a character
    assert any(c == "" for c in chunks)                        # held while the character was incomplete


def test_special_tokens_are_skipped_as_in_the_one_shot_decode(sentencepiece_bpe):
    tok = sentencepiece_bpe
    ids = [1] + tok.encode("the cat 🙂").ids + [2]
    chunks, rest = stream(tok, ids)
    assert "".join(chunks) + rest == tok.decode(ids) == "the cat 🙂"


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=48))
def test_any_id_sequence_streams_to_its_decode(byte_bpe, ids):
    """Random tokens (what a sampled random-weight model emits): bytes that never form a character too. Whatever the
    chunks held back comes out of flush, as the one-shot decode's U+FFFD."""
    chunks, rest = stream(byte_bpe, ids)
    assert "".join(chunks) + rest == byte_bpe.decode(ids)
    assert not any(c.endswith("\ufffd") for c in chunks)


def feed(st_, tok, text):
    return [st_.add(t) for t in tok.encode(text).ids]


def test_stop_strings_over_multibyte_text(byte_bpe):
    s = StopText(byte_bpe, ("世界", "END"))
    out = "".join(feed(s, byte_bpe, "héllo 🙂 世")) + "".join(feed(s, byte_bpe, "界 after"))
    assert s.stopped and out == s.text == "héllo 🙂 "
    s = StopText(byte_bpe, ("END",))
    deltas = feed(s, byte_bpe, "ab EN")
    assert "".join(deltas) == "ab " and not s.stopped              # "EN" might become "END"
    assert "".join(feed(s, byte_bpe, "x 漢")) == "ENx 漢"            # it did not
    assert s.flush() == "" and s.text == "ab ENx 漢"
    s = StopText(byte_bpe, ("xyz",))
    feed(s, byte_bpe, "a🙂xy")
    assert s.text == "a🙂" and s.flush() == "xy" and s.text == "a🙂xy"   # at the end a partial stop is text
    s = StopText(byte_bpe, ("b", "ab"))
    assert "".join(feed(s, byte_bpe, "cab")) == "c" and s.stopped   # within one step the earliest start wins


def test_a_long_stop_string_costs_each_step_its_new_text(byte_bpe):
    """A stop string of 200 000 characters whose prefix the text keeps matching: each step advances the matcher over
    the step's characters, where searching every prefix of the stop string at every step took O(L^2)."""
    stop = "ab" * 100_000 + "!"
    ids = byte_bpe.encode("ab" * 2000).ids
    s = StopText(byte_bpe, (stop, "zz"))
    t0 = time.perf_counter()
    assert all(s.add(t) == "" for t in ids)                     # all of it could still be the stop string
    assert time.perf_counter() - t0 < 5.0
    assert s.flush() == "ab" * 2000 and not s.stopped
    s = StopText(byte_bpe, ("ab" * 50 + "!",))
    text = "".join(s.add(t) for t in byte_bpe.encode("x" + "ab" * 60 + "!tail").ids)
    assert s.stopped and text == "x" + "ab" * 10                 # cut where the 101-character stop string starts
