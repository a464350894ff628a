"""benchmarks.greedy_trace's greedy traces and bench_decode's comparison of a hybrid's tokens with its plain split's, on
hand-made traces (a tie, a real divergence, the tie threshold) and on a real tiny CPU session (the trace's tokens
are what generate() returns, and a row's trace survives bench_decode's JSON)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.bench_decode import compare_rows, trace_fields
from benchmarks.greedy_trace import TIE_ULPS, GreedyTrace, compare_greedy, greedy_trace

ULP_AT_5 = float(np.spacing(np.float16(5.0)))       # 2^-8: fp16's step for logits in [4, 8)


def trace(tokens, leads, top=5.0):
    return GreedyTrace(tuple(tokens), (top,) * len(tokens), tuple(leads))


def test_equal_tokens_report_no_divergence():
    a = trace([3, 1, 4, 1], [0.5, 0.0, 0.2, 0.1])
    assert compare_greedy(a, a) == {"tokens_equal_split": True, "tokens_first_divergence_vs_split": 4}


def test_a_divergence_at_an_exact_tie_is_called_a_tie():
    # measured once: the hybrid's top two tied exactly (lead 0.0), the split led by one ulp
    hybrid = trace([7, 8, 131188, 5], [0.3, 0.2, 0.0, 0.4])
    split = trace([7, 8, 132025, 6], [0.3, 0.2, ULP_AT_5, 0.4])
    out = compare_greedy(hybrid, split)
    assert out["tokens_equal_split"] is False and out["tokens_first_divergence_vs_split"] == 2
    assert out["tokens_divergence_at_tie"] is True and out["tokens_divergence_leads"] == [0.0, ULP_AT_5]


def test_a_divergence_with_clear_leads_is_not_a_tie():
    a, b = trace([1, 2, 3], [0.5, 0.5, 0.5]), trace([1, 9, 3], [0.5, 0.25, 0.5])
    out = compare_greedy(a, b)
    assert out["tokens_first_divergence_vs_split"] == 1 and out["tokens_divergence_at_tie"] is False


def test_the_tie_threshold_is_two_fp16_ulps_of_the_top_logit():
    assert TIE_ULPS == 2
    assert trace([1], [2 * ULP_AT_5]).is_tie(0) and not trace([1], [3 * ULP_AT_5]).is_tie(0)
    # a larger logit has a larger ulp: 3 ulps at 5.0 is under 2 ulps at 10.0 (fp16's step doubles at 8)
    assert trace([1], [3 * ULP_AT_5], top=10.0).is_tie(0)
    with pytest.raises(AssertionError):
        trace([1], [-0.1])


@pytest.fixture(scope="module")
def cpu_session(tiny):
    from helmc.runtime.session import Session
    return Session.load(tiny.bundle("qwen3"))


def test_trace_tokens_are_generate_tokens_and_survive_json(cpu_session):
    s = cpu_session
    prompt, n = [5, 9, 13, 2, 7, 11], 12
    want = s.generate(prompt_ids=prompt, max_new_tokens=n, stop_at_eos=False).tokens
    t = greedy_trace(s, prompt, n)
    print(f"tokens {list(t.tokens)}; leads min {min(t.lead):.3e}")
    assert list(t.tokens) == list(want) and len(set(t.tokens)) > 1
    assert all(x >= 0 for x in t.lead) and s.position == 0            # the trace leaves the session reset
    s.reset()
    logits = s.forward(prompt)[-1]                                     # the first step's lead, recomputed
    assert t.lead[0] == pytest.approx(float(np.sort(logits)[-1] - np.sort(logits)[-2]), abs=0)
    row = json.loads(json.dumps(trace_fields(s, prompt, n, want)))     # as bench_decode's JSON holds it
    assert row["greedy_trace_equals_request"] is True
    assert compare_rows(row, row) == {"tokens_equal_split": True, "tokens_first_divergence_vs_split": n}
    assert trace_fields(s, prompt, n, list(want[:-1]) + [want[-1] + 1])["greedy_trace_equals_request"] is False
    other = json.loads(json.dumps(row))
    other["greedy_trace"]["tokens"][5] += 1                            # a split that parts at step 5
    out = compare_rows(row, other)
    assert out["tokens_first_divergence_vs_split"] == 5 and out["tokens_divergence_leads"] == [t.lead[5]] * 2
