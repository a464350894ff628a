"""Session 15 one-off: where a 128-token all-GPU prompt's time goes (cProfile of Session.forward after a warm-up).
Usage: python prefill_probe.py BUNDLE WEIGHTS"""
import cProfile
import pstats
import sys
import time

import numpy as np

from helmc.runtime.session import Session

s = Session.load(sys.argv[1], weights_dir=sys.argv[2])
rng = np.random.default_rng(0)
for i in range(3):
    prompt = rng.integers(3, 30000, 128).tolist()
    r = s.generate(prompt_ids=prompt, max_new_tokens=4, stop_at_eos=False)
    print(f"warm-up {i}: TTFT {r.ttft_ms:.1f} ms")
import cupy as cp
times = []
for i in range(5):
    s.reset()
    prompt = rng.integers(3, 30000, 128).tolist()
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    s.forward(prompt, argmax=True)
    times.append(1000 * (time.perf_counter() - t0))
print("forward(128) ms:", [f"{t:.1f}" for t in times])
s.reset()
pr = cProfile.Profile()
pr.enable()
s.forward(rng.integers(3, 30000, 128).tolist(), argmax=True)
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
pstats.Stats(pr).sort_stats("tottime").print_stats(15)
