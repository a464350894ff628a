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
