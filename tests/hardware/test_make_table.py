"""benchmarks/make_table.py: RESULTS.md is what benchmarks/results/*.json give, and a report's rows name the
placement, the budget and llama.cpp's run within that budget."""
from __future__ import annotations

import json

from benchmarks import make_table


def test_results_table_is_up_to_date():
    assert make_table.main(["--check"]) == 0, "benchmarks/RESULTS.md is stale: run python -m benchmarks.make_table"


def test_rows_pair_each_helmc_run_with_llamacpp_in_its_budget(tmp_path):
    report = {"label": "M", "device": "GPU X", "bandwidth": {"threads": 4}, "command": "python -m benchmarks.bench_decode",
              "helmc": [{"plan": "cpu(3) -> cuda(1), hybrid decode", "cpu_units": 3, "hybrid": True, "streamed_blocks": 2,
                         "gpu_budget_gib": 3.0, "decode_tok_s_p50": 12.0, "llamacpp_ngl_within_budget": 5,
                         "decode_ratio_vs_llamacpp_within_budget": 1.5},
                        {"plan": "cuda(4)", "cpu_units": 0, "variant": "all_gpu", "gpu_budget_gib": 70.0,
                         "decode_tok_s_p50": 90.0, "llamacpp_ngl_within_budget": 99,
                         "decode_ratio_vs_llamacpp_within_budget": 0.9}],
              "llamacpp": [{"ngl": 5, "decode_tok_s_p50": 8.0}, {"ngl": 99, "decode_tok_s_p50": 100.0}]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    text = make_table.table(str(tmp_path))
    assert "| M | 3 GiB | hybrid: CPU + 2 blocks streamed to the GPU | GPU X, 4 CPU threads | 12.0 | 8.0 (5) | 1.50 |" in text
    assert "| M | whole GPU | all on the GPU | GPU X, 4 CPU threads | 90.0 | 100.0 (99) | 0.90 |" in text
    out = tmp_path / "RESULTS.md"
    assert make_table.main(["--results", str(tmp_path), "--out", str(out), "--check"]) == 1   # missing: stale
    assert make_table.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert make_table.main(["--results", str(tmp_path), "--out", str(out), "--check"]) == 0


def test_served_rows_name_llamacpps_fastest_run_within_the_budget(tmp_path):
    report = {"label": "MoE", "device": "GPU X", "budget_gib": 8.0, "concurrency": 8,
              "command": "python -m benchmarks.bench_moe_serve b",
              "helmc": {"decode_tok_s_at_8": 130.0, "peak_vram_gib": 7.5},
              "llamacpp": [{"config": "ncmoe40", "decode_tok_s_at_8": 100.0, "peak_vram_gib": 4.9},
                           {"config": "ncmoe28", "decode_tok_s_at_8": 90.0, "peak_vram_gib": 7.9}],
              "llamacpp_fastest_within_budget": "ncmoe40", "moe_serve_ratio_vs_llamacpp": 1.3}
    (tmp_path / "moe_serve").mkdir()
    (tmp_path / "moe_serve" / "s.json").write_text(json.dumps(report))
    text = make_table.table(str(tmp_path))
    assert "| MoE | 8 GiB | 8 | GPU X | 130.0 | 7.50 | 100.0 (ncmoe40, 4.90) | 1.30 |" in text
    assert "- `moe_serve/s.json`: `python -m benchmarks.bench_moe_serve b`" in text
