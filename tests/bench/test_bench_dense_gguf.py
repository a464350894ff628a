"""benchmarks/bench_dense_gguf.py's cases over bench_decode rows and llama-bench runs: the budget case against the
fastest -ngl whose peak VRAM fits the budget, the all-GPU case against -ngl 99, the ratios and targets, and the table
row make_table writes from them."""
from __future__ import annotations

import pytest

from benchmarks import llamacpp_peer, make_table
from benchmarks.bench_dense_gguf import case_fields

LLAMA = [{"ngl": 14, "decode_tok_s_p50": 20.0, "peak_vram_gib": 3.3, "ttft_ms_p50": 900.0},
         {"ngl": 15, "decode_tok_s_p50": 21.0, "peak_vram_gib": 3.45, "ttft_ms_p50": 880.0},
         {"ngl": 16, "decode_tok_s_p50": 22.0, "peak_vram_gib": 3.6, "ttft_ms_p50": 860.0},
         {"ngl": 99, "decode_tok_s_p50": 150.0, "peak_vram_gib": 7.0, "ttft_ms_p50": 40.0}]


def row(tok_s: float, budget: float, variant: str | None = None) -> dict:
    r = {"decode_tok_s_p50": tok_s, "ttft_ms_p50": 300.0, "gpu_budget_gib": budget, "peak_vram_gib": budget - 0.1,
         "plan": "cuda(38)" if variant else "cpu(24) -> cuda(14)", "hybrid": not variant}
    if variant:
        r["variant"] = variant
    return r | llamacpp_peer.ratios(r, LLAMA, 128)


def test_budget_case_is_against_the_fastest_that_fits():
    c = case_fields("within_budget", row(31.5, 3.5), LLAMA, [{"decode_tok_s": 30.0}, {"error": "x"}])
    assert c["llamacpp_ngl"] == 15 and c["llamacpp_decode_tok_s"] == 21.0
    assert c["decode_ratio_vs_llamacpp"] == pytest.approx(1.5) and c["meets_target"] and c["target"] == 1.3
    assert c["oneshot_decode_ratio_vs_llamacpp"] == [round(30 / 21, 3)]
    assert c["oneshot_decode_ratio_vs_warm"] == [round(30 / 31.5, 3)]


def test_all_gpu_case_is_against_ngl_99():
    c = case_fields("all_gpu", row(160.0, 139.0, "all_gpu"), LLAMA, [])
    assert c["llamacpp_ngl"] == 99 and c["decode_ratio_vs_llamacpp"] == pytest.approx(160 / 150)
    assert not c["meets_target"] and c["target"] == 1.1


def test_no_run_within_the_budget_gives_no_ratio():
    c = case_fields("within_budget", row(31.5, 3.0), LLAMA, [])
    assert c["llamacpp_ngl"] is None and "decode_ratio_vs_llamacpp" not in c


def test_table_row_shows_the_case_comparison():
    budget, gpu = row(31.5, 3.5), row(160.0, 139.0, "all_gpu")
    for r, case in ((budget, "within_budget"), (gpu, "all_gpu")):
        c = case_fields(case, r, LLAMA, [])
        r["decode_ratio_vs_llamacpp"], r["llamacpp_ngl_compared"] = c["decode_ratio_vs_llamacpp"], c["llamacpp_ngl"]
    rows = make_table.rows({"label": "Qwen3-8B Q5_K_M", "device": "H200", "helmc": [budget, gpu], "llamacpp": LLAMA})
    assert [(r["budget"], r["ngl"], r["llamacpp"], round(r["ratio"], 3)) for r in rows] == [
        ("3.5 GiB", 15, 21.0, 1.5), ("whole GPU", 99, 150.0, round(160 / 150, 3))]
