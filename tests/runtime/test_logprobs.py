import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helmc.runtime.logprobs import MAX_TOP_LOGPROBS, log_softmax, token_logprob


def _reference(logits, i):
    m = max(logits)
    return logits[i] - (m + math.log(sum(math.exp(v - m) for v in logits)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=2, max_size=64), st.integers(0, 25), st.data())
def test_logprob_is_log_softmax_and_top_sorted(logits, top, data):
    tok = data.draw(st.integers(0, len(logits) - 1))
    r = token_logprob(np.array(logits, dtype=np.float32), tok, top)
    f32 = np.array(logits, dtype=np.float32).astype(float).tolist()
    assert r.logprob == pytest.approx(_reference(f32, tok), abs=1e-9)
    assert len(r.top) == min(top, MAX_TOP_LOGPROBS, len(logits))
    lps = [lp for _, lp in r.top]
    assert lps == sorted(lps, reverse=True)
    if r.top:
        assert r.top[0][1] == pytest.approx(max(_reference(f32, i) for i in range(len(f32))), abs=1e-9)


def test_greedy_token_is_first_of_top():
    logits = np.array([0.5, 3.0, -1.0, 2.9], dtype=np.float32)
    r = token_logprob(logits, int(np.argmax(logits)), 3)
    assert r.top[0][0] == 1 and [t for t, _ in r.top] == [1, 3, 0]
    assert np.exp(log_softmax(logits)).sum() == pytest.approx(1.0, abs=1e-12)


def test_out_of_range_token_refused():
    with pytest.raises(ValueError, match=r"token id in \[0, 4\) expected, found 7"):
        token_logprob(np.zeros(4), 7)


def _tokenizer(vocab: list[str], decoder):
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    tok.decoder = decoder
    return tok


def test_piece_bytes_of_a_character_split_over_tokens():
    """あ is E3 81 82 in UTF-8: each of its three tokens alone decodes to U+FFFD, its bytes come from the vocabulary
    entry (byte-level BPE's alphabet, or SentencePiece's <0xE3> byte fallback), and the three together spell it."""
    from tokenizers import decoders
    from helmc.runtime.logprobs import TokenPieces, _byte_level_decoder
    char_of = {b: c for c, b in _byte_level_decoder().items()}
    byte_level = _tokenizer(["<unk>", "Ġhi", *(char_of[b] for b in (0xE3, 0x81, 0x82))], decoders.ByteLevel())
    fallback = _tokenizer(["<unk>", "hi", "<0xE3>", "<0x81>", "<0x82>"], decoders.ByteFallback())
    for tok, hi in ((byte_level, (" hi", tuple(b" hi"))), (fallback, ("hi", tuple(b"hi")))):
        pieces = TokenPieces(tok)
        assert pieces(1) == hi
        parts = [pieces(i) for i in (2, 3, 4)]
        assert [t for t, _ in parts] == ["\ufffd"] * 3
        assert bytes(b for _, raw in parts for b in raw).decode("utf-8") == "あ" == tok.decode([2, 3, 4])


def test_pieces_name_a_step_and_stand_in_without_a_tokenizer():
    from helmc.runtime.logprobs import TokenPieces
    step = TokenPieces(None).name(token_logprob(np.array([1.0, 2.0, 0.0]), 0, 2))
    assert step.chosen.token == "token_id:0" and step.chosen.bytes is None
    assert [t.token for t in step.top] == ["token_id:1", "token_id:0"] and step.top[1].logprob == step.chosen.logprob


def test_masked_logit_floors_and_non_finite_logits_refused():
    from helmc.errors import HelmcError
    from helmc.runtime.logprobs import FLOOR
    r = token_logprob(np.array([0.0, -np.inf, 1.0], dtype=np.float32), 1, 3)
    assert r.logprob == FLOOR and [t for t, _ in r.top] == [2, 0, 1] and r.top[2][1] == FLOOR
    for bad in (np.nan, np.inf):
        with pytest.raises(HelmcError, match="log-probabilities: expected finite logits"):
            token_logprob(np.array([0.0, bad, 1.0]), 0)
