"""What the build-here / run-there kernel variant experiments (quant_gemv_variants.py, batch_gemv_variants.py) share:
one library of the variants plus helmc's stream read over >= 4x the target's L3, and, there, a timer of that read
(the DRAM figure each variant is held against in the same run)."""
from __future__ import annotations

import json
import os
import time

import numpy as np


def export_variants(out_dir: str, funcs: dict, kernels: list[dict], features: tuple[str, ...], l3: int, isa) -> None:
    """funcs: symbol -> PrimFunc (its global symbol set here); kernels: what run() reads back (variants.json)."""
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements

    funcs = {n: f.with_attr("global_symbol", n) for n, f in funcs.items()}
    elements = stream_read_elements(4 * l3, isa)
    funcs["helmc_stream_read"] = make_stream_read(elements, isa)
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), target=llvm_target(features))
    os.makedirs(out_dir, exist_ok=True)
    lib.export_library(os.path.join(out_dir, "variants.so"))
    with open(os.path.join(out_dir, "variants.json"), "w") as f:
        json.dump({"kernels": kernels, "read_elements": elements, "l3": l3, "isa": isa.tier}, f, indent=1)


def load_variants(out_dir: str):
    """(meta, lib, read_gbs) there, with tvm.runtime only: read_gbs() times one pass of the stream read."""
    import tvm

    meta = json.load(open(os.path.join(out_dir, "variants.json")))
    lib = tvm.runtime.load_module(os.path.join(out_dir, "variants.so"))
    read = lib["helmc_stream_read"]
    buf = tvm.runtime.tensor(np.full(meta["read_elements"], 1.0, np.float32))
    partial = tvm.runtime.tensor(np.zeros(1024, np.float32))   # READ_TASKS

    def read_gbs():
        t = time.perf_counter()
        read(buf, partial)
        return 4 * meta["read_elements"] / (time.perf_counter() - t) / 1e9
    return meta, lib, read_gbs
