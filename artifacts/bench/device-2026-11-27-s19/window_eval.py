# Session 19, offline (no device): run from the repository root with PYTHONPATH=.; reads call B's profile and
# results here and the bundles' model_spec.json / plan.json in .devrt/s19b (gitignored).
"""Call B's hybrid layout (Q4_K 3 GiB; the fp16 7 GiB replan chose a plain split from that window) evaluated by the cost model under call B's profile: with its DRAM + PCIe window as
measured (29.3 + 53.5 GB/s, a disturbance: the GEMVs read 96.5 alone a second later) and with call A's window
(86.6 + 47.2 beside 89.3 and 55.4 alone, same host class) scaled to call B's own alone rates."""
import dataclasses, json, re

from helmc.hardware.profile import HardwareProfile
from helmc.model.spec import ModelSpec
from helmc.planner.calibrate import predict_bundle
from helmc.planner.hybrid import forced_layout
from helmc.runtime.bundle.plan import Plan

D = "artifacts/bench/device-2026-11-27-s19"
hw = HardwareProfile.load(f"{D}/callB/profile.json")
a = HardwareProfile.load(f"{D}/callA/profile.json")
link = dataclasses.replace(
    hw.link, cpu_read_concurrent_gbs=hw.cpu.host_read_gbs * a.link.cpu_read_concurrent_gbs / a.cpu.host_read_gbs,
    h2d_concurrent_gbs=hw.link.h2d_gbs * a.link.h2d_concurrent_gbs / a.link.h2d_gbs)
scaled = dataclasses.replace(hw, link=link)
for name, bdir in (("q4k_3g", ".devrt/s19b/s17_q4k_3g"),):
    row = json.load(open(f"{D}/callB/{name}.json"))["helmc"][0]
    sizes = [int(b or a) - int(a) + 1 for _, a, b in re.findall(r"([CS])\d+\[(\d+)(?:\.\.(\d+))?\]",
                                                                row["hybrid_schedule"])]
    pairs = tuple((sizes[i], sizes[i + 1]) for i in range(0, len(sizes), 2))
    spec = ModelSpec.from_json(open(f"{bdir}/model_spec.json").read())
    p = forced_layout(Plan.from_json(open(f"{bdir}/plan.json").read()), spec, pairs)
    meas = row["per_token_ms_p50"]
    t_b = predict_bundle(spec, p, hw, 128, 64).t_plan_ms
    t_a = predict_bundle(spec, p, scaled, 128, 64).t_plan_ms
    print(f"{name}: {len(pairs)} pairs; measured {meas:.1f} ms; window as measured {t_b:.1f} ({meas / t_b:.3f}); "
          f"call A's window scaled {t_a:.1f} ({meas / t_a:.3f})")
