"""Where a long prompt's prefill time goes on the GPU machine (issue 5 follow-up: 32K prefill took 97 s).

    PYTHONPATH=. python experiments/device_prefill_profile.py BUNDLE --weights DIR --tokens 8192 [--out F.json]

Loads the bundle, runs one prefill of --tokens random ids, and times (CUDA-synchronised wrappers, so
the parts add up to the wall time) the streamed prefill's block DMAs, compiled pre/post functions and
attention, the GPU stage's compiled functions and KV-cache attention, and the host-side rest. The
wrappers synchronise after every call, so the total is a little above an unwrapped prefill.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out")
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    from helmc.runtime import paged_attention, prefill_stream
    from helmc.runtime.session import Session

    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(name, fn):
        def wrapper(*a, **kw):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            cp.cuda.Device().synchronize()
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
            return out
        return wrapper

    s = Session.load(args.bundle, weights_dir=args.weights)
    gpu = s.gpu
    sp = gpu.streamed_prefill
    if sp is not None:
        sp.pre, sp.post = timed("stream: pre_attn", sp.pre), timed("stream: post_attn", sp.post)
        prefill_stream.attend_blocks = timed("stream: attention", paged_attention.attend_blocks)
        sp.cpu_kv.append = timed("stream: K/V to host cache", sp.cpu_kv.append)
    st = gpu.stage
    if st is not None:
        st._pre = {k: timed(f"gpu stage: pre_attn ({k})", f) for k, f in st._pre.items()}
        st._post = {k: timed(f"gpu stage: post_attn ({k})", f) for k, f in st._post.items()}
        st.kv.append = timed("gpu stage: KV append", st.kv.append)
        st.kv.attend = timed("gpu stage: KV attention", st.kv.attend)
    ids = np.random.default_rng(0).integers(100, 150000, args.tokens).tolist()
    s.reset()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    s.forward(ids)
    cp.cuda.Device().synchronize()
    total = time.perf_counter() - t0
    rows = sorted(spent.items(), key=lambda kv: -kv[1])
    rest = total - sum(spent.values())
    rec = {"bundle": args.bundle, "tokens": args.tokens, "total_s": round(total, 3),
           "parts": {k: {"s": round(v, 3), "calls": calls[k]} for k, v in rows}, "rest_s": round(rest, 3),
           "borrowed_kv_pool": getattr(sp, "borrowed", None), "peak_pool_bytes": cp.get_default_memory_pool().total_bytes()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    print(f"prefill of {args.tokens} tokens: {total:.2f} s (streamed prefill borrowed the KV pool: {rec['borrowed_kv_pool']})")
    for k, v in rows:
        print(f"  {k:<32} {v:8.2f} s  {calls[k]:6d} calls")
    print(f"  {'rest (host, embedding, head)':<32} {rest:8.2f} s")


if __name__ == "__main__":
    main()
