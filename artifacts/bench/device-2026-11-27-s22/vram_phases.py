"""Where a bundle's VRAM goes beyond its plan (session 22, call B): load it with its plan made again from a profile
under a budget, run one request, and print the device's used memory after each phase beside the plan's parts and
CuPy's pool. The profile's gpu reserve (planner/measure_reserve.py, the kit's all-GPU stage) measured 0.335 GiB where
the real split runs used ~0.51 (fp16) and ~0.59 (Q4_K) beyond their plans (call A).

  python vram_phases.py BUNDLE WEIGHTS PROFILE BUDGET_GIB
"""
import json
import subprocess
import sys
import threading
import time

GIB = 2 ** 30


def used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         stdout=subprocess.PIPE, text=True).stdout.split()
    return int(out[0])


def main(bundle, weights, profile, budget):
    base = used_mib()
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], used_mib() - base)
            time.sleep(0.02)
    threading.Thread(target=sample, daemon=True).start()
    from helmc.hardware.profile import load_hardware
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.session import Session
    hw = load_hardware(profile)
    plan, spec = replan_bundle(bundle, hw, gpu_budget_gib=float(budget))
    phases = {"base_mib": base}
    import cupy
    cupy.cuda.runtime.getDeviceCount()
    cupy.zeros(1)
    phases["context_mib"] = used_mib() - base
    s = Session.load(bundle, weights, plan=plan)
    phases["loaded_mib"] = used_mib() - base
    pool = cupy.get_default_memory_pool()
    phases["cupy_pool_after_load_mib"] = (pool.used_bytes() >> 20, pool.total_bytes() >> 20)
    s.generate(prompt_ids=[3 + i for i in range(128)], max_new_tokens=16, stop_at_eos=False)
    phases["after_request_mib"] = used_mib() - base
    phases["cupy_pool_after_request_mib"] = (pool.used_bytes() >> 20, pool.total_bytes() >> 20)
    time.sleep(0.1)
    stop.set()
    phases["peak_mib"] = peak[0]
    gpu_need = plan.usable_vram_bytes - hw.with_gpu_budget(float(budget)).gpu_reserve_bytes
    phases["plan"] = {"describe": plan.describe(), "usable_mib": plan.usable_vram_bytes >> 20,
                      "reserve_mib": hw.gpu_reserve_bytes >> 20, "planned_mib": gpu_need >> 20,
                      "gpu_weights_mib": plan.gpu_weight_bytes >> 20, "kv_pool_mib": plan.gpu_kv_pool_bytes >> 20,
                      "ring_mib": plan.staging_ring_bytes >> 20, "prefill_staging_mib": plan.prefill_staging_bytes >> 20,
                      "gpu_bytes_mib": plan.gpu_bytes >> 20}
    phases["beyond_plan_mib"] = peak[0] - (gpu_need >> 20)
    print(json.dumps(phases))


if __name__ == "__main__":
    main(*sys.argv[1:5])
