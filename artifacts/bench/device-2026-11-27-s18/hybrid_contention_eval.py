# Session 18, offline (no device): run from the repository root with PYTHONPATH=.; reads the profiles and results
# recorded under artifacts/bench and the bundles' model_spec.json / plan.json in .devrt/s17 (gitignored).
"""Offline: each measured hybrid run's layout evaluated by the cost model under its run's profile: as planned
(Contention.of: a CPU demand within the window's DRAM + PCIe total loses nothing) and with the window's slowdowns
applied whatever the demand (window ratios: CPU alone / CPU together, copies alone / copies together)."""
import json, re

from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.planner import hybrid as H
from helmc.planner.calibrate import predict_bundle
from helmc.planner.hybrid import forced_layout
from helmc.runtime.bundle.plan import Plan

B = "artifacts/bench"
runs = [  # (label, profile json, result json)
    ("s16 B fp16", f"{B}/device-2026-11-27-s16/callB/profile_kit4.json", f"{B}/device-2026-11-27-s16/callB/fp16_7g.json"),
    ("s16 C fp16", f"{B}/device-2026-11-27-s16/callC/profile.json", f"{B}/device-2026-11-27-s16/callC/fp16_7g_replanned.json"),
    ("s17 E fp16", f"{B}/device-2026-11-27-s17/callE/profile.json", f"{B}/device-2026-11-27-s17/callE/fp16_7g.json"),
    ("s17 A q4k", f"{B}/device-2026-11-27-s17/callA/profile.json", f"{B}/device-2026-11-27-s17/callA/q4k_3g.json"),
    ("s18 A fp16", f"{B}/device-2026-11-27-s18/callA/profile.json", f"{B}/device-2026-11-27-s18/callA/fp16_7g.json"),
    ("s18 A q4k", f"{B}/device-2026-11-27-s18/callA/profile.json", f"{B}/device-2026-11-27-s18/callA/q4k_3g.json"),
    ("s18 B fp16", f"{B}/device-2026-11-27-s18/callB/profile.json", f"{B}/device-2026-11-27-s18/callB/fp16_7g.json"),
    ("s18 B q4k", f"{B}/device-2026-11-27-s18/callB/profile.json", f"{B}/device-2026-11-27-s18/callB/q4k_3g.json"),
]
orig_of = H.Contention.of.__func__


def window_ratios(cls, hw, cpu_rates):
    """The planner's own fields: M (fp16 GEMVs alone) / the window's CPU rate, B / the window's copy rate; a demand
    over the window's total still shares the excess as Contention.of does (the larger slowdowns win)."""
    link = hw.link
    m_f = hw.cpu.host_read_gbs or hw.cpu.stream_gbs
    floor = cls(max(1.0, m_f / link.cpu_read_concurrent_gbs), max(1.0, link.h2d_gbs / link.h2d_concurrent_gbs))
    c = orig_of(cls, hw, cpu_rates)
    return cls(max(c.cpu_slowdown, floor.cpu_slowdown), max(c.copy_slowdown, floor.copy_slowdown))


for label, prof, res in runs:
    hw = HardwareProfile.load(prof)
    for row in json.load(open(res))["helmc"]:
        if not row.get("hybrid"):
            continue
        sizes = [int(b or a) - int(a) + 1 for _, a, b in re.findall(r"([CS])\d+\[(\d+)(?:\.\.(\d+))?\]",
                                                                    row["hybrid_schedule"])]
        pairs = tuple((sizes[i], sizes[i + 1]) for i in range(0, len(sizes), 2))
        bdir = ".devrt/s17/" + ("s16_q4k_3g" if "q4k" in row["bundle"] else "s16_fp16_7g_hyb")
        spec = ModelSpec.from_json(open(f"{bdir}/model_spec.json").read())
        p = forced_layout(Plan.from_json(open(f"{bdir}/plan.json").read()), spec, pairs)
        old = predict_bundle(spec, p, hw, 128, 64).t_plan_ms
        H.Contention.of = classmethod(window_ratios)
        new = predict_bundle(spec, p, hw, 128, 64).t_plan_ms
        H.Contention.of = classmethod(orig_of)
        meas = row["per_token_ms_p50"]
        print(f"{label:11s} {len(pairs):2d} pairs, {sum(s for _, s in pairs):2d} streamed: measured {meas:6.1f} ms; "
              f"as planned {old:6.1f} ({meas / old:.3f}); window ratios {new:6.1f} ({meas / new:.3f})")
