#!/usr/bin/env python3
"""Where a CPU block's prefill time goes: each compiled kernel of a bench_cpu_block.py build, timed alone.

TVM 0.27's Relax VM has no per-call profiler, so this calls the library's PrimFuncs directly. Their argument
shapes come from the signatures TVM embeds in the library (`name(arg: Tensor([seq, T.int64(4096)], float32),
...)`); every function whose signature has a symbolic token count is a prefill kernel and runs at --prompt tokens
on random inputs. Each figure is the best of --rounds calls after one warm-up, with one copy of each weight
(so a GEMM's weights may sit in L3: a lower bound beside bench_cpu_block.py's DRAM-cycled block time).

--decode times the decode kernels instead (every signature without a symbolic dimension), each cycling
through copies of its arguments that total >= 4x L3, as the block bench's decode step does, so weights come
from DRAM; the figure is per call (a pass over the copies divided by their number), with GB/s of its arguments.

  python experiments/profile_cpu_block.py DIR [--prompt 128] [--rounds 10] [--decode]   # DIR from bench_cpu_block.py
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

SIGNATURE = re.compile(rb"(?:^|[\x00\n])([A-Za-z_][A-Za-z0-9_]*)\(((?:[A-Za-z0-9_]+: Tensor\(\[[^\]]*\], [a-z0-9]+\)(?:, )?)+)\)")
MAX_COPIES = 256   # decode: tiny kernels get this many argument sets (their per-call time includes the launch)
ARG = re.compile(r"([A-Za-z0-9_]+): Tensor\(\[([^\]]*)\], ([a-z0-9]+)\)")


def kernel_signatures(path: str, decode: bool = False) -> dict[str, list[tuple[tuple[str, ...], str]]]:
    """name -> [(dims as written, dtype)] for every embedded signature with a symbolic token count (`seq` in
    TVM's legalised functions, `tokens` in helmc's GEMMs); with `decode`, every one without."""
    data = open(path, "rb").read()
    found = {}
    for m in SIGNATURE.finditer(data):
        name, args = m.group(1).decode(), m.group(2).decode()
        if ("seq" in args or "tokens" in args) == decode:
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


def dispatch_overhead(out_dir: str, kernel_ms: dict, rounds: int) -> None:
    """pre_attn_decode through the VM with one weight set (50 MB for 8B: L3-resident, so no DRAM in it)
    against the same kernels called directly, also L3-resident: the difference is what a VM call adds
    (argument passing, the VM's instructions, intermediate allocation, the serial gaps between launches)."""
    import json

    import numpy as np
    import tvm.runtime
    from tvm.runtime.vm import VirtualMachine
    from helmc.model.spec import ModelSpec
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, tensor_from_numpy

    manifest = json.load(open(os.path.join(out_dir, "block_bench.json")))
    spec = ModelSpec.from_json(json.dumps(manifest["spec"]))
    dev = tvm.runtime.cpu()
    vm = VirtualMachine(tvm.runtime.load_module(os.path.join(out_dir, "block.so")), dev)
    rng = np.random.default_rng(0)
    shapes = spec.block_weight_shapes()
    ws = []
    for name in manifest["weights"]["pre_attn"]:
        vals = rng.standard_normal(shapes[name], dtype=np.float32) * np.float32(0.02)
        ws.append(tensor_from_numpy(bf16_bits_from_float32(vals) if spec.dtype == "bfloat16" else
                                    vals.astype(spec.dtype), spec.dtype, dev))
    D = spec.head_dim
    x, cos, sin = (tensor_from_numpy(rng.standard_normal(s, dtype=np.float32), "float32", dev)
                   for s in ((1, spec.hidden_size), (1, D), (1, D)))
    fn = vm["pre_attn_decode"]
    fn(x, cos, sin, *ws)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(20):
            fn(x, cos, sin, *ws)
        best = min(best, (time.perf_counter() - t) / 20)
    gemv = sum(ms for name, ms in kernel_ms.items() if name.startswith("helmc_gemv3"))
    print(f"pre_attn_decode through the VM, L3-resident weights: {best * 1e3:.3f} ms; its fused q/k/v GEMV alone, "
          f"same residency: {gemv:.3f} ms; every other decode kernel once: "
          f"{sum(kernel_ms.values()) - sum(ms for n, ms in kernel_ms.items() if n.startswith('helmc_gemv')):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--decode", action="store_true", help="decode kernels, arguments cycled from DRAM")
    ap.add_argument("--dispatch", action="store_true",
                    help="decode kernels with one L3-resident argument set, and pre_attn_decode through the VM")
    args = ap.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import numpy as np
    import tvm.runtime
    from helmc.runtime.tvm_tensors import bf16_bits_from_float32, tensor_from_numpy

    path = os.path.join(args.dir, "block.so")
    lib = tvm.runtime.load_module(path).imports[0]
    rng = np.random.default_rng(0)
    dev = tvm.runtime.cpu()
    from bench_cpu_gemv import l3_bytes
    rows = []
    for name, sig in sorted(kernel_signatures(path, args.decode or args.dispatch).items()):
        host = []
        for dims, dtype in sig:
            shape = tuple(dim_value(d, args.prompt) for d in dims)
            vals = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
            host.append((bf16_bits_from_float32(vals) if dtype == "bfloat16" else vals.astype(dtype)
                         if dtype.startswith("float") else np.zeros(shape, dtype), dtype))
        nbytes = sum(a.nbytes for a, _ in host)
        copies = min(MAX_COPIES, -(-4 * l3_bytes() // nbytes)) if args.decode and not args.dispatch else 1
        sets = [[tensor_from_numpy(a, dtype, dev) for a, dtype in host] for _ in range(copies)]
        fn = lib.get_function(name)
        fn(*sets[0])
        best = float("inf")
        reps = 20 if args.dispatch else 1   # dispatch: back to back, as the VM runs them
        for _ in range(args.rounds):
            time.sleep(0.05)   # let the previous call's spinning workers sleep, as in the block bench
            t = time.perf_counter()
            for _ in range(reps):
                for tensors in sets:
                    fn(*tensors)
            best = min(best, (time.perf_counter() - t) / copies / reps)
        rows.append((best * 1e3, name, nbytes))
        del sets
    rows.sort(reverse=True)
    what = ("decode kernels, one argument set (L3-resident), 20 calls back to back" if args.dispatch else
            f"decode kernels, arguments cycled over >= 4x L3 (at most {MAX_COPIES} copies)" if args.decode else
            f"prefill kernels, {args.prompt} tokens, one weight copy (L3 may hold it)")
    print(f"{what} of {path}, best of {args.rounds}")
    for ms, name, nbytes in rows:
        print(f"  {ms:8.3f} ms  {name[:90]}  ({nbytes / 1e6:.1f} MB of arguments, {nbytes / ms / 1e6:.1f} GB/s)")
    linear = sum(ms for ms, name, _ in rows if name.startswith(("helmc_gemm", "helmc_gemv")))
    print(f"  sum {sum(r[0] for r in rows):.2f} ms: linears {linear:.2f} ms, the rest {sum(r[0] for r in rows) - linear:.2f} ms")
    if args.dispatch:
        dispatch_overhead(args.dir, {name: ms for ms, name, _ in rows}, args.rounds)


if __name__ == "__main__":
    main()
