"""bench_moe_serve's rates from the client's chunk stamps: the decode window and a stream whose text came at once."""
import pytest

from benchmarks.bench_moe_serve import rates


def test_decode_window_opens_at_the_last_streamed_first_chunk():
    recs = [{"t_submit": 0.0, "stamps": [1.0, 2.0, 5.0], "tokens": 8},
            {"t_submit": 0.5, "stamps": [2.0, 3.0, 4.0], "tokens": 8}]
    r = rates(recs, 8)
    assert r["decode_tok_s_at_2"] == pytest.approx(2 * 7 / (5.0 - 2.0))
    assert r["end_to_end_tok_s_at_2"] == pytest.approx(16 / 5.0) and r["ttft_ms_max"] == pytest.approx(2000.0)


def test_a_stream_held_to_its_end_leaves_the_window_to_the_others():
    # its one chunk at the very end would make the window empty (a division by zero)
    recs = [{"t_submit": 0.0, "stamps": [1.0, 3.0], "tokens": 4}, {"t_submit": 0.0, "stamps": [3.0], "tokens": 4}]
    assert rates(recs, 4)["decode_tok_s_at_2"] == pytest.approx(2 * 3 / 2.0)


def test_a_short_stream_is_refused():
    with pytest.raises(RuntimeError, match="expected 4 tokens"):
        rates([{"t_submit": 0.0, "stamps": [1.0, 2.0], "tokens": 3}], 4)
