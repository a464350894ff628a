"""benchmarks/bench_context.py's CPU-side parts: argument checks, the dry run, time limits, how a worker's
output (including one cut off by its time limit, or one that crashed) becomes records, the summary."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_context as bc

CONTEXTS = [1024, 8192, 32768]


def result(**rec) -> str:
    return "RESULT " + json.dumps(rec)


def test_help_and_dry_run(capsys):
    with pytest.raises(SystemExit) as e:
        bc.main(["--help"])
    assert e.value.code == 0 and "--hf-time" in capsys.readouterr().out
    assert bc.main(["--bundle", "b", "--hf-model", "m", "--dry-run", "--total-time", "390"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["helmc: contexts [1024, 8192, 32768], 16 new tokens each, GPU budget 7.0 GiB, at most 320 s",
                   "hf: contexts [1024, 8192, 32768], 16 new tokens each, GPU budget 7.0 GiB, at most 70 s"]
    assert bc.main(["--systems", "helmc", "--bundle", "b", "--contexts", "8192", "1024,32768", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("helmc: contexts [1024, 8192, 32768],")
    for bad in (["--systems", "helmc", "--bundle", "b", "--contexts", "1k"], ["--systems", "vllm"],
                ["--systems", "hf"], ["--systems", "helmc", "--bundle", "b", "--contexts", "8"]):
        with pytest.raises(SystemExit) as e:
            bc.main(bad + ["--dry-run"])
        assert e.value.code == 2


def test_time_limits_share_the_total():
    assert bc.time_limits(["helmc", "hf"], {"helmc": 330, "hf": 200}, 540) == [("helmc", 330), ("hf", 200)]
    assert bc.time_limits(["hf", "helmc"], {"helmc": 330, "hf": 200}, 300) == [("hf", 200), ("helmc", 100)]


def test_a_worker_cut_off_by_its_time_limit():
    out = "\n".join([
        "loading...",
        result(system="helmc", event="loaded", load_s=7.7),
        result(system="helmc", event="start", context=1024),
        result(system="helmc", context=1024, status="ok", prefill_s=1.5, decode_tok_s=12.0, vram_peak_gib=6.8),
        result(system="helmc", event="start", context=8192)])
    recs = bc.parse_records("helmc", out, "timeout", "", CONTEXTS, 330)
    by_ctx = {r["context"]: r for r in recs if "context" in r}
    assert [by_ctx[c]["status"] for c in CONTEXTS] == ["ok", "timeout", "not_run"]
    assert "330 s" in by_ctx[8192]["why"] and recs[-1]["event"] == "exit"
    s = bc.summarize(recs, CONTEXTS)["helmc"]
    assert s["largest_context"] == 1024 and s["failures"] == {8192: "timeout", 32768: "not_run"}
    assert "ratio_32768_vs_1024" not in s


def test_summary_ratio_and_oom():
    recs = [{"system": "helmc", "context": c, "status": "ok", "prefill_s": 1.0, "decode_tok_s": t}
            for c, t in zip(CONTEXTS, (10.0, 9.0, 7.5))]
    recs += [{"system": "hf", "context": 1024, "status": "ok", "prefill_s": 2.0, "decode_tok_s": 0.9},
             {"system": "hf", "context": 8192, "status": "oom"}, {"system": "hf", "context": 32768, "status": "skipped"}]
    s = bc.summarize(recs, CONTEXTS)
    assert s["helmc"]["largest_context"] == 32768 and s["helmc"]["ratio_32768_vs_1024"] == 0.75
    assert s["hf"]["largest_context"] == 1024 and s["hf"]["failures"] == {8192: "oom", 32768: "skipped"}


def test_real_worker_that_cannot_start_is_recorded(tmp_path):
    """The helmc worker needs CuPy: without it (this machine) the process exits, and every context
    is recorded as not run, with the reason in the stderr tail."""
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: the worker would really run")
    except ImportError:
        pass
    recs = bc.run_worker("helmc", ["--bundle", str(tmp_path), "--systems", "helmc"], 60, CONTEXTS)
    assert [r["status"] for r in recs if "context" in r] == ["not_run"] * 3
    assert recs[-1]["event"] == "exit" and recs[-1]["rc"] == 1 and "cupy" in recs[-1]["stderr_tail"]
