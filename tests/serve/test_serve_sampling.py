"""Per-request sampling (runtime/sampling.py): the options change what is drawn as documented, a seed repeats
a draw, and StopText releases text without a stop string or half a character."""
import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.runtime.sampling import Sampler, SamplingParams, StopText


def test_greedy_and_penalties():
    logits = np.array([0.0, 3.0, 2.9, -1.0, 1.0])
    assert Sampler(SamplingParams())(logits) == 1
    s = Sampler(SamplingParams(frequency_penalty=0.2))
    assert [s(logits) for _ in range(3)] == [1, 2, 1]        # 3.0-0.2 < 2.9; then 2.9-0.2 < 2.8
    s = Sampler(SamplingParams(presence_penalty=2.0))
    row = logits + [0, 0, 0, 0, 0.2]
    assert [s(row) for _ in range(5)] == [1, 2, 4, 1, 1]     # once seen, minus 2 however often (1 stays at 1.0)
    # transformers' repetition penalty: prompt tokens too; a positive logit divided, a negative one multiplied
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[1])
    assert s(logits) == 2
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[1, 2, 4])
    assert s(np.array([0.8, 1.0, 1.5, -1.0, -0.1])) == 0      # 1.0 -> 0.5, 1.5 -> 0.75: 0.8 is the top
    assert s(np.array([-0.3, -0.2, -5, -5, -5])) == 1          # 0 now generated: -0.3 -> -0.6 below -0.2 -> -0.4
    assert s.counts == {0: 1, 1: 1}


def test_plain_greedy_is_the_argmax_alone():
    """Session.generate finds a plain-greedy request's token where the logits are (the GPU's argmax) and take()s
    it: that is only right when the choice is the argmax and nothing else."""
    logits = np.array([0.0, 3.0, 2.9, -1.0, 3.0])
    s = Sampler(SamplingParams())
    assert s.plain_greedy and s(logits) == int(np.argmax(logits)) == 1      # the first of equal maxima
    assert s.take(np.int64(4)) == 4 and s.counts == {1: 1, 4: 1}
    for p in (SamplingParams(temperature=0.5), SamplingParams(frequency_penalty=0.1),
              SamplingParams(repetition_penalty=1.1), SamplingParams(presence_penalty=-0.5)):
        assert not Sampler(p).plain_greedy, p


def test_seed_repeats_and_cuts_hold():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64)
    p = SamplingParams(temperature=1.0, seed=7)
    a, b = Sampler(p), Sampler(p)
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]
    top3 = set(np.argsort(-logits)[:3])
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=1))
    assert {s(logits) for _ in range(200)} <= top3
    best = int(np.argmax(logits))
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.999, seed=1))     # only the top token is within 0.999 of itself
    assert {s(logits) for _ in range(50)} == {best}


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -1.0, "temperature expected >= 0, found -1.0"), ("top_p", 0.0, "top_p expected in (0, 1]"),
    ("min_p", 1.5, "min_p expected in [0, 1]"), ("presence_penalty", 3.0, "presence_penalty expected in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty expected > 0"), ("max_tokens", 0, "max_tokens expected >= 1"),
    ("stop", ("",), "stop expected non-empty strings")])
def test_bad_params(field, value, msg):
    with pytest.raises(HelmcError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


class CharTokenizer:
    """Token i is chr(i); 0xE9 is split into two byte tokens 1000, 1001 (a character over two tokens)."""

    def decode(self, ids):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 1000:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == 1001 else "\ufffd")
                i += 2 if i + 1 < len(ids) else 1
            else:
                out.append(chr(ids[i]))
                i += 1
        return "".join(out)


def feed(st, text_or_ids):
    ids = [ord(c) for c in text_or_ids] if isinstance(text_or_ids, str) else text_or_ids
    return [st.add(t) for t in ids]


def test_stop_text_holds_a_partial_stop_and_cuts_before_it():
    st = StopText(CharTokenizer(), ("END", "\n\n"))
    deltas = feed(st, "ab EN")
    assert deltas == ["a", "b", " ", "", ""] and not st.stopped           # "EN" might become "END"
    assert feed(st, "x") == ["ENx"]                                        # it did not
    assert feed(st, "yEND") == ["y", "", "", ""] and st.stopped
    assert st.text == "ab ENxy" and feed(st, "z") == [""]                 # nothing after the stop


def test_stop_text_flush_and_multibyte():
    st = StopText(CharTokenizer(), ("xyz",))
    assert feed(st, [ord("a"), 1000, 1001]) == ["a", "", "é"]            # half a character waits for the rest
    assert feed(st, "xy") == ["", ""]
    assert st.flush() == "xy" and st.text == "aéxy"                       # at the end a partial stop is text
    st = StopText(CharTokenizer(), ("b", "ab"))
    feed(st, "cab")
    assert st.stopped and st.text == "c"                                   # the earliest stop string wins
