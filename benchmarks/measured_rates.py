"""What a loaded session's decode read per second, beside its plan and the profile it was planned from (does
the profile tell the truth about this machine?). bench_decode's rows for a split's CPU stage and for a hybrid
decode bundle; pure Python over the session's counters and the bundle's JSON, so it runs where the session does.

    cpu_stage_fields(session, plan, step_seconds, hw)   # the CPU stage's weight read against hw's stage read and M
    hybrid_fields(session, plan, per_token_ms, hw)      # bytes through the staging ring, host weights' DRAM + PCIe share
"""
from __future__ import annotations

import json
import os
import statistics

from helmc.planner.analyze_program import analyze_program

GB = 1e9


def read_bytes(spec, plan) -> tuple[int, int]:
    """Weight bytes (host, GPU) read per decode token: the units' W_param, one embedding row (analyze_program's)."""
    a = analyze_program(spec)
    return tuple(x.param_bytes + x.gather_bytes_per_token for x in (a.stage(0, plan.placement.cpu_units),
                                                                    a.stage(plan.placement.cpu_units, a.num_units)))


def cpu_stage_fields(s, plan, steps: list[float], hw) -> dict:
    """The CPU stage's read of its blocks' weights over its median step against `hw` (--profile, or the bundle's):
    profile_dram_vs_measured (1.0: the profile told the truth) is the profile's synthetic stage read (M
    where a profile lacks it) over it; M's (GEMVs alone) and the stream read's are the other two ratios."""
    nbytes, ms = sum(s.spec.block_weight_bytes(i) for i in plan.placement.cpu_layers), 1e3 * statistics.median(steps)
    out = {"cpu_stage_blocks": len(plan.placement.cpu_layers), "cpu_stage_ms_p50": ms, "cpu_stage_read_gbs": nbytes / ms / 1e6}
    for rate, name in ((hw.cpu.stage_read_gbs or hw.cpu.host_read_gbs, "profile_dram_vs_measured"),
                       (hw.cpu.host_read_gbs, "profile_gemv_read_vs_measured"),
                       (hw.cpu.dram_gbs, "profile_stream_read_vs_measured")):
        if rate and nbytes:
            out[name] = rate / out["cpu_stage_read_gbs"]
    return out


def hybrid_fields(s, plan, per_token_ms: float, hw=None) -> dict:
    """What a hybrid decode bundle adds to its row: its groups, the bytes through the staging ring per token and
    their PCIe rate, the host weights' rate per token (CPU groups and copies both read host DRAM) and its share of
    the DRAM + PCIe rate measured together by `hw` (--profile: this run's) or else the bundle's profile."""
    h = s.gpu.hybrid
    per_token = h.backend.bytes_copied / max(1, h.tokens)
    out = {"hybrid_schedule": h.schedule.describe(), "hybrid_pairs": len(h.schedule.pairs),
           "streamed_blocks": len(h.schedule.streamed_layers), "ring_bytes": h.schedule.ring_bytes,
           "t_copy_ms": plan.predictions.t_copy_ms, "streamed_bytes_per_token": per_token,
           "pcie_gbs": per_token / (per_token_ms * 1e-3) / GB,
           "host_weight_gbs": read_bytes(s.spec, plan)[0] / (per_token_ms * 1e-3) / GB}
    link = {}
    if hw is not None and hw.link is not None:      # --profile's (this run's), else the bundle's own
        link = {"h2d_concurrent_gbs": hw.link.h2d_concurrent_gbs, "cpu_read_concurrent_gbs": hw.link.cpu_read_concurrent_gbs}
    elif os.path.isfile(path := os.path.join(s.bundle_dir, "hardware.json")):
        with open(path) as f:
            link = json.load(f).get("link") or {}
    if link.get("h2d_concurrent_gbs"):
        out["profile_dram_pcie_gbs"] = link["h2d_concurrent_gbs"] + link.get("cpu_read_concurrent_gbs", 0.0)
        out["share_of_dram_pcie"] = out["host_weight_gbs"] / out["profile_dram_pcie_gbs"]
    return out
