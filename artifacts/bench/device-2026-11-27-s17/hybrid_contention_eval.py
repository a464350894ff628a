# Session 17, offline (no device): run from the repository root with PYTHONPATH=.; reads the
# profiles and results recorded under artifacts/bench and the bundles in .devrt/s17 (gitignored: rebuild them to rerun).
"""Offline: each measured hybrid run's layout evaluated by the cost model under its run's profile, with the window's
figures as recorded (current model) and with the window's own alone rates (the window-relative model)."""
import dataclasses, json, re, sys

from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.planner import hybrid as H
from helmc.planner.calibrate import predict_bundle
from helmc.planner.hybrid import forced_layout
from helmc.runtime.bundle.plan import Plan

B = "artifacts/bench"
runs = [  # (label, profile json, result json, row index, measured ms)
    ("s16 B 12x(1+1)", f"{B}/device-2026-11-27-s16/callB/profile_kit4.json", f"{B}/device-2026-11-27-s16/callB/fp16_7g.json"),
    ("s16 C 12x(1+1)", f"{B}/device-2026-11-27-s16/callC/profile.json", f"{B}/device-2026-11-27-s16/callC/fp16_7g_replanned.json"),
    ("s17 E 8x(2+1)", f"{B}/device-2026-11-27-s17/callE/profile.json", f"{B}/device-2026-11-27-s17/callE/fp16_7g.json"),
    ("s17 A q4k 7x(1+4)", f"{B}/device-2026-11-27-s17/callA/profile.json", f"{B}/device-2026-11-27-s17/callA/q4k_3g.json"),
]
spec_dir = ".devrt/s17"
for label, prof, res in runs:
    hw = HardwareProfile.load(prof)
    note = next(n for n in hw.notes if n.startswith("DRAM + PCIe at once"))
    cpu_alone, h2d_alone = map(float, re.findall(r"alone ([0-9.]+)", note))
    d = json.load(open(res))
    for row in d["helmc"]:
        if not row.get("hybrid"):
            continue
        sched = row["hybrid_schedule"]
        groups = re.findall(r"([CS])\d+\[(\d+)(?:\.\.(\d+))?\]", sched)
        sizes = [(k, int(b or a) - int(a) + 1) for k, a, b in groups]
        pairs = tuple((sizes[i][1], sizes[i + 1][1]) for i in range(0, len(sizes), 2))
        bundle = row["bundle"].replace(".devrt/s17/", "").replace(".devrt/", "")
        bdir = f"{spec_dir}/{bundle}" if "q4k" in bundle or "s16" in bundle else None
        bdir = bdir or f"{spec_dir}/s16_fp16_7g_hyb"
        spec = ModelSpec.from_json(open(f"{bdir}/model_spec.json").read())
        plan = Plan.from_json(open(f"{bdir}/plan.json").read())
        p = forced_layout(plan, spec, pairs)
        old = predict_bundle(spec, p, hw, 128, 64).t_plan_ms
        orig_of = H.Contention.of.__func__

        def window_relative(cls, hw2, cpu_rates, cpu_alone=cpu_alone, h2d_alone=h2d_alone):
            link = hw2.link
            scale = cpu_alone / (hw2.cpu.host_read_gbs or hw2.cpu.stream_gbs)   # the rounds' M in the window's moment
            m = cpu_rates.mem_gbs * scale
            b = h2d_alone
            capacity = link.cpu_read_concurrent_gbs + link.h2d_concurrent_gbs
            excess = m + b - capacity
            if excess <= 0:
                return cls(1.0, 1.0)
            cpu_lost, copy_lost = max(0.0, cpu_alone - link.cpu_read_concurrent_gbs), max(0.0, b - link.h2d_concurrent_gbs)
            if cpu_lost + copy_lost <= 0:
                cpu_lost, copy_lost = m, b
            share = cpu_lost / (cpu_lost + copy_lost)
            return cls(m / max(m - excess * share, 1e-9 * m), b / max(b - excess * (1 - share), 1e-9 * b))
        H.Contention.of = classmethod(window_relative)
        new = predict_bundle(spec, p, hw, 128, 64).t_plan_ms
        H.Contention.of = classmethod(orig_of)
        meas = row["per_token_ms_p50"]
        print(f"{label:20s} pairs {pairs[:2]}..x{len(pairs)} M {hw.cpu.host_read_gbs:.1f} window alone {cpu_alone}/{h2d_alone} "
              f"together {hw.link.cpu_read_concurrent_gbs}/{hw.link.h2d_concurrent_gbs}: measured {meas:.1f}, "
              f"old {old:.1f} ({meas / old:.3f}), window-relative {new:.1f} ({meas / new:.3f})")
