import sys, time, numpy as np
sys.path.insert(0, "scripts")
import bench_serve as bs
from helmc.runtime.serve.load import load_engine
engine, _ = load_engine(sys.argv[1], 8, weights_dir=sys.argv[2], quiet=True)
bs.time_cpu_stage(engine.model)
rng = np.random.default_rng(0)
prompts = [[int(x) for x in rng.integers(1, 32000, size=128)] for _ in range(8)]
bs.run_requests(engine, prompts[:1], 8, "warm")
for rnd in range(2):
    steps = []
    bs.run_requests(engine, prompts, 64, f"all{rnd}", steps)
    dec = [s for s in steps if s["decoded"] == 8 and not s["prefilled"]]
    ms = [1000 * s["s"] for s in dec]
    print(f"round {rnd}: {len(dec)} steps, mean {np.mean(ms):.1f} median {np.median(ms):.1f} max {max(ms):.1f} tok/s {8*len(dec)/sum(s['s'] for s in dec):.2f}")
    big = sorted(range(len(steps)), key=lambda i: -steps[i]["s"])[:6]
    for i in big:
        s = steps[i]; print("  step", i, {k: (round(v * 1000, 1) if k.endswith("s") else v) for k, v in s.items()})
