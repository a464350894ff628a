"""bench_moe_serve's rates from the client's chunk stamps: the decode window and a stream whose text came at once."""
import pytest

from benchmarks.bench_moe_serve import rates, ratio


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


def test_the_ratio_is_to_llamacpps_fastest_within_the_budget_and_says_whether_helmc_fits():
    from types import SimpleNamespace
    a = SimpleNamespace(concurrency=8, budget_gib=8.0)
    report = {"helmc": {"decode_tok_s_at_8": 120.0, "peak_vram_gib": 8.3},
              "llamacpp": [{"config": "ncmoe40", "decode_tok_s_at_8": 100.0, "peak_vram_gib": 4.9},
                           {"config": "ncmoe24", "decode_tok_s_at_8": 150.0, "peak_vram_gib": 9.1}]}
    r = ratio(report, a)
    assert r["llamacpp_fastest_within_budget"] == "ncmoe40" and r["moe_serve_ratio_vs_llamacpp"] == pytest.approx(1.2)
    assert r["helmc_within_budget"] is False
    report["helmc"]["peak_vram_gib"] = 7.9
    assert ratio(report, a)["helmc_within_budget"] is True
