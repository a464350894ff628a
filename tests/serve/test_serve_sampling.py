"""Per-request sampling (runtime/sampling.py): the options change what is drawn as documented, a seed repeats
a draw. StopText's stop strings over the detokenizer: tests/runtime/test_detokenize.py."""
import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.runtime.sampling import Sampler, SamplingParams


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

