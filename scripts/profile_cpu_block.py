#!/usr/bin/env python3
"""Where a CPU block's prefill time goes: each compiled kernel of a bench_cpu_block.py build, timed alone.

TVM 0.27's Relax VM has no per-call profiler, so this calls the library's PrimFuncs directly. Their argument
shapes come from the signatures TVM embeds in the library (`name(arg: Tensor([seq, T.int64(4096)], float32),
...)`); every function whose signature has a symbolic token count is a prefill kernel and runs at --prompt tokens
on random inputs. Each figure is the best of --rounds calls after one warm-up, with one copy of each weight
(so a GEMM's weights may sit in L3: a lower bound beside bench_cpu_block.py's DRAM-cycled block time).

  python scripts/profile_cpu_block.py DIR [--prompt 128] [--rounds 10]      # DIR from bench_cpu_block.py
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

SIGNATURE = re.compile(rb"(?:^|[\x00\n])([A-Za-z_][A-Za-z0-9_]*)\(((?:[A-Za-z0-9_]+: Tensor\(\[[^\]]*\], [a-z0-9]+\)(?:, )?)+)\)")
ARG = re.compile(r"([A-Za-z0-9_]+): Tensor\(\[([^\]]*)\], ([a-z0-9]+)\)")


def prefill_signatures(path: str) -> dict[str, list[tuple[tuple[str, ...], str]]]:
    """name -> [(dims as written, dtype)] for every embedded signature with a symbolic token count (`seq` in
    TVM's legalised functions, `tokens` in helmc's GEMMs)."""
    data = open(path, "rb").read()
    found = {}
    for m in SIGNATURE.finditer(data):
        name, args = m.group(1).decode(), m.group(2).decode()
        if "seq" not in args and "tokens" not in args:
            continue
        found[name] = [(tuple(d.strip() for d in dims.split(",") if d.strip()), dtype)
                       for _, dims, dtype in ARG.findall(args)]
    return found


def dim_value(text: str, seq: int) -> int:
    if text in ("seq", "tokens"):
        return seq
    m = re.fullmatch(r"T\.int64\((\d+)\)|(\d+)", text)
    if not m:
        raise ValueError(f"profile_cpu_block: expected seq, tokens, N or T.int64(N) in a signature, found {text!r}")
    return int(m.group(1) or m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np
    import tvm.runtime
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, tensor_from_numpy

    path = os.path.join(args.dir, "block.so")
    lib = tvm.runtime.load_module(path).imports[0]
    rng = np.random.default_rng(0)
    dev = tvm.runtime.cpu()
    rows = []
    for name, sig in sorted(prefill_signatures(path).items()):
        tensors = []
        for dims, dtype in sig:
            shape = tuple(dim_value(d, args.prompt) for d in dims)
            vals = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
            if dtype == "bfloat16":
                tensors.append(tensor_from_numpy(bf16_bits_from_float32(vals), dtype, dev))
            elif dtype.startswith("float"):
                tensors.append(tensor_from_numpy(vals.astype(dtype), dtype, dev))
            else:
                tensors.append(tensor_from_numpy(np.zeros(shape, dtype), dtype, dev))
        fn = lib.get_function(name)
        fn(*tensors)
        best = float("inf")
        for _ in range(args.rounds):
            time.sleep(0.05)   # let the previous call's spinning workers sleep, as in the block bench
            t = time.perf_counter()
            fn(*tensors)
            best = min(best, time.perf_counter() - t)
        rows.append((best * 1e3, name, sum(int(np.prod(t.shape)) for t in tensors)))
    rows.sort(reverse=True)
    print(f"prefill kernels of {path}, {args.prompt} tokens, best of {args.rounds} (one weight copy: L3 may hold it)")
    for ms, name, elems in rows:
        print(f"  {ms:8.3f} ms  {name[:90]}  ({elems / 1e6:.1f} M elements in its arguments)")
    gemm = sum(ms for ms, name, _ in rows if name.startswith("helmc_gemm"))
    print(f"  sum {sum(r[0] for r in rows):.2f} ms: GEMMs {gemm:.2f} ms, the rest {sum(r[0] for r in rows) - gemm:.2f} ms")


if __name__ == "__main__":
    main()
