"""A batched decode step's host experts on this CPU: the m-row expert sum (schedules/cpu/quant/moe_experts_rows.py)
against the one-row expert sum called once per row (what a step would take without it), at a MoE model's shapes
(default Qwen3-30B-A3B: 128 experts of 768 x 2048, top-8, q4_k gate/up and q6_k down), random weights.

    python -m benchmarks.bench_moe_rows_cpu [--experts 128 --inter 768 --hidden 2048 --top-k 8] [--rows 1,8,32,128] \
        [--reps 30] [--tile PAIRS] [--out benchmarks/results/moe_rows_cpu.json]

--rows 128 is a CPU prompt chunk (each expert picked by ~8 rows); --tile sets the m-row kernel's pairs of one expert
per gate/up tile (moe_experts_rows.PAIR_TILE by default).

Rows select their experts either independently or sharing half of them with the first row (a served batch of
related prompts); per row count m and sharing: the median ms of each, the distinct experts' bytes over the m-row
time, and whether every row's output equals the one-row kernel's bit for bit. Compiles for this CPU (needs the TVM
compiler: run it on the compiler machine or wherever helmc builds).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _weights(rng, E: int, I: int, H: int):
    """Random q4_k gate/up [E * I, H / 256 * 144] and q6_k down [E * H, I / 256 * 210] rows with small scales."""
    gb, db = H // 256 * 144, I // 256 * 210
    gate, up = (rng.integers(0, 256, (E * I, gb), dtype=np.uint8) for _ in range(2))
    for w in (gate, up):
        w.reshape(E * I, -1, 144)[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.001], np.float16).tobytes(), np.uint8)
    down = rng.integers(0, 256, (E * H, db), dtype=np.uint8)
    down.reshape(E * H, -1, 210)[:, :, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return gate, up, down


def _selection(rng, m: int, E: int, K: int, shared: bool) -> np.ndarray:
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(m)])
    if shared:
        for r in range(1, m):
            rest = [e for e in rng.permutation(E) if e not in idx[0, :K // 2]][:K - K // 2]
            idx[r] = np.concatenate([idx[0, :K // 2], rest])
    return idx


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main(argv=None) -> int:
    import tvm

    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
    from helmc.runtime.bundle.manifest import host_cpu_flags
    from helmc.runtime.moe_experts import expert_rows_args
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.quant.moe_experts import make_moe_expert_sum
    from helmc.schedules.cpu.quant.moe_experts_rows import PAIR_TILE, make_moe_expert_rows
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tile", type=int, default=None, help="pairs of one expert decoded together (default PAIR_TILE)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    E, I, H, K = a.experts, a.inter, a.hidden, a.top_k
    flags = host_cpu_flags()
    isa = select_isa(flags)
    if isa.tier != "avx512":
        sys.exit("bench_moe_rows_cpu: the int8 expert sums need AVX-512; this CPU has none")
    kernels = {}
    rows_kernel = make_moe_expert_rows("q4_k", "q6_k", E, I, H, K, isa, tile=a.tile or PAIR_TILE)
    for name, f in (("rows", rows_kernel), ("one", make_moe_expert_sum("q4_k", "q6_k", E, I, H, K, isa))):
        kernels[name] = tvm.compile(f, target=llvm_target(tuple(flags)))[str(f.attrs["global_symbol"])]
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    gate, up, down = _weights(rng, E, I, H)
    W = [tvm.runtime.tensor(w, dev) for w in (gate, up, down)]
    expert_bytes = gate.nbytes // E * 2 + down.nbytes // E
    report = {"shapes": {"experts": E, "inter": I, "hidden": H, "top_k": K, "types": "q4_k/q6_k"}, "rows": []}
    for shared in (False, True):
        for m in (int(v) for v in a.rows.split(",")):
            idx = _selection(rng, m, E, K, shared)
            w = rng.uniform(0.05, 0.2, idx.shape).astype(np.float32)
            x = rng.standard_normal((m, H)).astype(np.float32)
            args = [tvm.runtime.tensor(v, dev) for v in expert_rows_args(idx, w)]
            y, xt = tvm.runtime.empty((m, H), "float32", dev), tvm.runtime.tensor(x, dev)
            ones = []
            for r in range(m):
                o = np.argsort(idx[r])
                ones.append([tvm.runtime.tensor(v, dev) for v in (x[r:r + 1], idx[r][o].astype(np.int32), w[r][o])]
                            + [tvm.runtime.empty((1, H), "float32", dev)])
            t_rows = _median_ms(lambda: kernels["rows"](xt, *args, *W, y), a.reps)
            t_one = _median_ms(lambda: [kernels["one"](o[0], o[1], o[2], *W, o[3]) for o in ones], a.reps)
            same = all(np.array_equal(y.numpy()[r], ones[r][3].numpy()[0]) for r in range(m))
            distinct = len(np.unique(idx))
            row = {"m": m, "shared_half": shared, "distinct_experts": distinct, "m_row_ms": t_rows,
                   "one_row_per_row_ms": t_one, "speedup": t_one / t_rows,
                   "m_row_gb_s": distinct * expert_bytes / t_rows / 1e6, "bit_identical": same}
            report["rows"].append(row)
            print(f"{'half shared' if shared else 'independent'} m={m}: {distinct} experts, m-row {t_rows:.3f} ms "
                  f"({row['m_row_gb_s']:.1f} GB/s), one-row x m {t_one:.3f} ms, x{row['speedup']:.2f}, "
                  f"bit-identical {same}", flush=True)
            if not same:
                raise SystemExit("bench_moe_rows_cpu: a row of the m-row sum differs from its one-row sum")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
