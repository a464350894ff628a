"""benchmarks/llamacpp_peer.py's comparisons of bench_decode's helmc rows with llama.cpp's runs, on stand-in rows
(no GPU, no llama-bench): which -ngl fits helmc's VRAM, and the ratios that existed before that one; and
bench_serve's split of its decode steps."""
from __future__ import annotations

import pytest

from benchmarks import llamacpp_peer

LLAMA = [{"ngl": 0, "decode_tok_s_p50": 8.0, "ttft_ms_p50": 800.0, "peak_vram_gib": 0.5},
         {"ngl": 10, "decode_tok_s_p50": 16.0, "ttft_ms_p50": 400.0, "peak_vram_gib": 3.0},
         {"ngl": 20, "decode_tok_s_p50": 12.0, "ttft_ms_p50": 300.0, "peak_vram_gib": 5.75},
         {"ngl": 99, "decode_tok_s_p50": 64.0, "ttft_ms_p50": 100.0, "peak_vram_gib": 16.5}]


def helmc_row(peak_vram_gib):
    return {"decode_tok_s_p50": 24.0, "ttft_ms_p50": 200.0, "peak_vram_gib": peak_vram_gib}


def test_within_vram_takes_the_fastest_run_that_fits():
    # -ngl 20 fits 6 GiB too, but -ngl 10 decodes faster in less: the peer is the fastest that fits, not the largest.
    assert llamacpp_peer.within_vram(helmc_row(6.0), LLAMA) == {"llamacpp_ngl_within_vram": 10,
                                                                "decode_ratio_vs_llamacpp_within_vram": 1.5}
    assert llamacpp_peer.within_vram(helmc_row(16.5), LLAMA) == {"llamacpp_ngl_within_vram": 99,   # equal fits
                                                                 "decode_ratio_vs_llamacpp_within_vram": 0.375}
    assert llamacpp_peer.within_vram(helmc_row(0.5), LLAMA)["llamacpp_ngl_within_vram"] == 0


@pytest.mark.parametrize("peak, llama", [
    (0.25, LLAMA),                                                         # no -ngl fits
    (None, LLAMA),                                                         # helmc's VRAM unmeasured
    (6.0, [dict(r, peak_vram_gib=None) for r in LLAMA]),                   # llama.cpp's unmeasured
])
def test_within_vram_none_without_a_fit_or_a_figure(peak, llama):
    assert llamacpp_peer.within_vram(helmc_row(peak), llama) == {"llamacpp_ngl_within_vram": None,
                                                                 "decode_ratio_vs_llamacpp_within_vram": None}


def test_within_budget_takes_the_fastest_run_within_the_plans_budget():
    """The hybrid benchmark's comparison: llama.cpp's fastest -ngl within the budget helmc's plan was made for, whatever helmc's
    own peak (which is said beside it)."""
    row = dict(helmc_row(2.9), gpu_budget_gib=3.0, hybrid=True)
    assert llamacpp_peer.within_budget(row, LLAMA) == {
        "helmc_within_budget": True, "llamacpp_ngl_within_budget": 10, "decode_ratio_vs_llamacpp_within_budget": 1.5,
        "hybrid_decode_ratio_vs_llamacpp_within_budget": 1.5}
    assert llamacpp_peer.within_vram(row, LLAMA)["llamacpp_ngl_within_vram"] == 0      # helmc held less than -ngl 10
    over = llamacpp_peer.within_budget(dict(helmc_row(3.01), gpu_budget_gib=3.0), LLAMA)
    assert over["helmc_within_budget"] is False and "hybrid_decode_ratio_vs_llamacpp_within_budget" not in over
    assert llamacpp_peer.within_budget(dict(helmc_row(2.0), gpu_budget_gib=0.25), LLAMA)[
        "decode_ratio_vs_llamacpp_within_budget"] is None                              # no -ngl within it
    assert llamacpp_peer.within_budget(helmc_row(2.0), LLAMA) == {}                     # no budget: nothing


def test_ratios_keep_their_keys_and_add_the_vram_match():
    r = llamacpp_peer.ratios(dict(helmc_row(6.0), hybrid=True), LLAMA[:2], prompt_len=32768)
    assert r == {"decode_ratio_vs_llamacpp_ngl0": 3.0, "ttft_ratio_vs_llamacpp_ngl0": 0.25,
                 "prefill_speedup_vs_llamacpp_ngl0": 4.0,
                 "prefill_32k_ratio_vs_llamacpp": 2.0,                     # against the faster prompt, -ngl 10's
                 "decode_ratio_vs_llamacpp_ngl10": 1.5, "ttft_ratio_vs_llamacpp_ngl10": 0.5,
                 "prefill_speedup_vs_llamacpp_ngl10": 2.0,
                 "decode_ratio_vs_llamacpp_best": 1.5, "hybrid_decode_ratio_vs_llamacpp": 1.5,
                 "llamacpp_ngl_within_vram": 10, "decode_ratio_vs_llamacpp_within_vram": 1.5}
    # With a budget the hybrid's ratio is the benchmark's: against the fastest -ngl within it (-ngl 10, 16 tok/s), not the
    # run's best (-ngl 99, 64 tok/s, 16.5 GiB)
    budgeted = llamacpp_peer.ratios(dict(helmc_row(2.9), hybrid=True, gpu_budget_gib=3.0), LLAMA, prompt_len=128)
    assert budgeted["hybrid_decode_ratio_vs_llamacpp"] == 1.5 and budgeted["decode_ratio_vs_llamacpp_best"] == 0.375
    tight = llamacpp_peer.ratios(dict(helmc_row(0.2), hybrid=True, gpu_budget_gib=0.25), LLAMA, prompt_len=128)
    assert tight["hybrid_decode_ratio_vs_llamacpp"] == 0.375                  # no -ngl within 0.25 GiB: the best
    unmeasured = {k: v for k, v in helmc_row(None).items() if k != "peak_vram_gib"}    # a row from before the figure
    assert llamacpp_peer.ratios(unmeasured, LLAMA, prompt_len=128)["decode_ratio_vs_llamacpp_within_vram"] is None


def test_bench_decode_takes_the_peer_options(capsys):
    from benchmarks import bench_decode

    with pytest.raises(SystemExit) as e:
        bench_decode.main(["--help"])
    assert e.value.code == 0 and "--llama-ngl" in capsys.readouterr().out


@pytest.mark.parametrize("args, why", [(["--variants", "split"], "without --replan"),
                                       (["--profile", "p.json", "--replan", "--variants", "split,cpu"], "'split,cpu'")])
def test_bench_decode_refuses_variants_it_cannot_run(capsys, args, why):
    # --variants replans each bundle (a plain split in its budget, the whole GPU): only with --replan, only those two
    from benchmarks import bench_decode

    with pytest.raises(SystemExit) as e:
        bench_decode.main(["--model", "m"] + args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--variants expected split and/or all_gpu" in err and why in err


def test_bench_serve_names_its_slowest_decode_steps():
    """bench_serve's step split: medians over the pure decode steps of n sequences (steps with a prefill or fewer
    sequences left out), their mean, and the slowest with their index among all steps and their parts."""
    from benchmarks import bench_serve

    def step(ms, decoded=8, prefilled=0, cpu=0.0):
        return dict({key: 0.0 for key in bench_serve.TIMERS}, s=ms / 1e3, decoded=decoded, prefilled=prefilled,
                    cpu_s=cpu / 1e3)
    steps = [step(3000, prefilled=8)] + [step(100, cpu=80)] * 4 + [step(2100, cpu=2050), step(50, decoded=3)]
    out = bench_serve.step_split(steps, 8, slowest=2)
    assert out["step_ms"] == pytest.approx(100) and out["cpu_stage_ms"] == pytest.approx(80)
    assert out["step_ms_mean"] == pytest.approx((4 * 100 + 2100) / 5)
    assert [(s["step"], s["step_ms"], s["cpu_stage_ms"]) for s in out["slowest"]] == [(5, 2100.0, 2050.0),
                                                                                       (1, 100.0, 80.0)]
    assert bench_serve.step_split(steps, 4) == {}
