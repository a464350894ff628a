"""Decode attention at short contexts, kernel by kernel, on the GPU (issue 16: the split kernel's 14.8 us a layer at
~190 tokens in session 20's Nsight table, 533 us of a 4.9 ms step).

Times one layer's launch inside a CUDA graph of LAYERS back-to-back launches (as a decode step replays them), for
Qwen3-8B's attention shape (8 KV heads, 4 query heads each, head_dim 128, 512-token pages):
  split       paged_decode_fused_append with the splits decode_splits.plan_splits picks for the page count
  short wWuU  paged_decode_short_append (schedules/gpu/paged_decode_short.py) with W warps, U rows in flight
and checks each output against the split kernel's (max |difference|, fp16).

    python experiments/paged_decode_variants.py build CUBIN_DIR     # here: nvcc -> one cubin per short variant
    python experiments/paged_decode_variants.py run CUBIN_DIR       # on the GPU machine (CuPy)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H_KV, GROUP, D, T = 8, 4, 128, 512
LAYERS, REPLAYS = 36, 30
SHORT = {"w8u8": (8, 8), "w16u4": (16, 4), "w16u8": (16, 8), "w32u2": (32, 2), "w32u4": (32, 4)}
CONTEXTS = (64, 190, 320, 512, 1000, 2000, 4000, 8000)
N_PAGES = 16


def build(out_dir: str) -> None:
    from helmc.compiler.passes.compile_gpu_stage import compile_cuda_source
    from helmc.schedules.gpu.paged_attention import DECODE_SOURCE, kernel_defines
    from helmc.schedules.gpu.paged_decode_short import SHORT_SOURCE
    os.makedirs(out_dir, exist_ok=True)
    old = os.environ.get("OLD_SOURCE")           # a paged_attention.py from before: its split kernel as "old"
    if old:
        import importlib.util
        spec = importlib.util.spec_from_file_location("old_paged_attention", old)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        compile_cuda_source(mod.DECODE_SOURCE, "sm_90", os.path.join(out_dir, "old.cubin"),
                            defines=kernel_defines(D, GROUP))
    for name, (w, u) in SHORT.items():
        compile_cuda_source(DECODE_SOURCE + SHORT_SOURCE, "sm_90", os.path.join(out_dir, f"{name}.cubin"),
                            defines=kernel_defines(D, GROUP) + (f"-DSHORT_WARPS={w}", f"-DSHORT_UNROLL={u}"))
        print("built", name)


def run(cubin_dir: str, out_path: str | None) -> None:
    import cupy as cp
    rng = np.random.default_rng(0)
    from helmc.runtime.kv.decode_splits import plan_splits
    n_pages = N_PAGES
    pool = cp.asarray(rng.standard_normal((n_pages, 2, H_KV, T, D)).astype(np.float16))   # [page, K/V, h_kv, T, d]
    ptrs = cp.asarray(np.array([pool[i].data.ptr for i in range(n_pages)], np.int64))
    q = cp.asarray(rng.standard_normal((H_KV * GROUP, D)).astype(np.float16))
    k_new = cp.asarray(rng.standard_normal((H_KV, D)).astype(np.float16))
    v_new = cp.asarray(rng.standard_normal((H_KV, D)).astype(np.float16))
    pm, ps = cp.empty(64 * 32, np.float32), cp.empty(64 * 32, np.float32)
    po = cp.empty(64 * 32 * D, np.float32)
    counters = cp.zeros(H_KV, np.int32)
    out = cp.empty((H_KV * GROUP, D), np.float16)
    step = cp.zeros(2, np.int32)
    scale = np.float32(D ** -0.5)
    i32 = np.int32
    mods = {name: cp.RawModule(path=os.path.join(cubin_dir, f"{name}.cubin")) for name in SHORT}
    split_k = next(iter(mods.values())).get_function("paged_decode_fused_append")
    old_path = os.path.join(cubin_dir, "old.cubin")
    old_k = cp.RawModule(path=old_path).get_function("paged_decode_fused_append") if os.path.isfile(old_path) else None
    stream = cp.cuda.Stream(non_blocking=True)

    def timed(launch) -> float:
        """us per launch: LAYERS launches captured once, replayed REPLAYS times."""
        with stream:
            launch()
            stream.begin_capture()
            for _ in range(LAYERS):
                launch()
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            for _ in range(REPLAYS):
                graph.launch(stream)
            b.record(stream)
            b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) * 1e3 / (REPLAYS * LAYERS)

    rows = []
    for n in CONTEXTS:
        step.set(np.array([n, 0], np.int32))
        res = {"tokens": n}
        ref = None
        span, n_splits, _, _, _ = plan_splits(-(-n // T), T, cp.cuda.Device().attributes["MultiProcessorCount"],
                                              H_KV, 16, lambda i: True)
        def launch(kernel, span=span, n_splits=n_splits):
            kernel((H_KV, n_splits), (128,), (q, k_new, v_new, ptrs, i32(T), step, i32(span), i32(0),
                   i32(n_splits), i32(H_KV), scale, pm, ps, po, counters, out))
        if old_k is not None:
            res["split_old_us"] = round(timed(lambda: launch(old_k)), 2)
            ref_old = out.get()
        res["split_us"] = round(timed(lambda: launch(split_k)), 2)
        res["split_config"] = f"{n_splits}x{span}"
        ref = out.get()
        if old_k is not None:
            res["split_old_bits_equal"] = bool(np.array_equal(ref.view(np.uint16), ref_old.view(np.uint16)))
        for name, (w, u) in SHORT.items():
            fn = mods[name].get_function("paged_decode_short_append")
            def launch(fn=fn, w=w):
                fn((H_KV, GROUP), (w * 32,), (q, k_new, v_new, ptrs, i32(T), step, i32(H_KV), scale, out))
            res[f"short_{name}_us"] = round(timed(launch), 2)
            res[f"short_{name}_maxdiff"] = float(np.abs(out.get().astype(np.float32) - ref.astype(np.float32)).max())
        rows.append(res)
        print(json.dumps(res))
    keys = [k for k in rows[0] if k.endswith("_us")]
    print("split configs (splits x tokens):", [r["split_config"] for r in rows])
    print("| tokens | " + " | ".join(k[:-3] for k in keys) + " |")
    for r in rows:
        print(f"| {r['tokens']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    print("split kernel bits equal to the old one's:", [r.get("split_old_bits_equal") for r in rows])
    print("max |diff| vs split, any variant:", max(v for r in rows for k, v in r.items() if k.endswith("maxdiff")))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"shape": {"h_kv": H_KV, "group": GROUP, "head_dim": D, "page_tokens": T}, "layers": LAYERS,
                       "replays": REPLAYS, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("build", "run"))
    ap.add_argument("cubins")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    build(a.cubins) if a.mode == "build" else run(a.cubins, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
