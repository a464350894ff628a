"""Session 17, one-off: where a split's CPU stage spends its decode step on the device's Xeon.
  cpu_stage_probe.py step  BUNDLE MODEL OUT.json   per block: pre_attn / post_attn VM calls, KV append and attention
                                                   (mean and median), the Python between them, the whole step
  cpu_stage_probe.py place BUNDLE MODEL OUT.json   the post_attn / pre_attn calls back to back over 12 blocks: on the
                                                   weights as bound, then on copies in one fresh anonymous arena (4 KiB
                                                   pages, as the profile's), then one advised MADV_HUGEPAGE
  cpu_stage_probe.py gap KIT BUNDLE MODEL OUT.json  the profile's fp16 GEMV pass (host_read.GemvPass, the kit's kernels)
                                                   on a pinned arena and on an anonymous one, before and after the
                                                   session loads, and the same GEMVs on the session's bound weights
  cpu_stage_probe.py kernels BUNDLE MODEL OUT.json the compiled kernels of pre_attn / post_attn called one by one
                                                   (the VM's own order, read from its bytecode) over 12 blocks: each
                                                   kernel's time, the GEMVs alone, the profile's GEMV pass order
Everything else is the real runtime (Session.load of the bundle, its compiled functions)."""
import json
import os
import statistics
import sys
import time

import numpy as np

from helmc.runtime import stage as st

stages = []
_init = st.Stage.__init__


def _record(self, *a, **k):
    _init(self, *a, **k)
    stages.append(self)


st.Stage.__init__ = _record
from helmc.runtime.session import Session  # noqa: E402

mode = sys.argv[1]
kit_rates = {}
if mode == "gap":
    from helmc.hardware.host_read import Arena, GemvPass, KitLibrary, arena_bytes, median_gbs
    from helmc.hardware.kit import ProfileKit
    kit_dir = sys.argv.pop(2)
    kit = ProfileKit.load(kit_dir)
    klib = KitLibrary(kit_dir, kit)

    def kit_pass(label, pinned):
        arena = Arena(arena_bytes(kit), pinned)
        rates = []
        for _ in range(3):
            g = GemvPass(klib, arena, "float16")
            rates += median_gbs(g.nbytes, g.run, 5)[1]
            del g
        kit_rates[label] = statistics.median(rates)
        del arena

    kit_pass("before_pinned", True)
    kit_pass("before_anon", False)
bundle, model, out = sys.argv[2:5]
s = Session.load(bundle, weights_dir=model)
prompt = [(1000 + i) % s.spec.vocab_size for i in range(128)]
s.generate(prompt_ids=prompt, max_new_tokens=8, temperature=0.0, stop_at_eos=False)
cpu = [x for x in stages if x.name == "cpu"][0]
spec = s.spec
H, qd, kvd, F = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
pre_bytes, post_bytes = 2 * H * (qd + 2 * kvd), 2 * (qd * H + 3 * H * F)
if mode == "gap":
    mode = "kernels"
    kit_pass("after_pinned", True)
    kit_pass("after_anon", False)
res = {"kit_fp16_gemv_gbs": kit_rates, "mode": mode, "env": {k: v for k, v in os.environ.items() if k.startswith("TVM_")},
       "affinity": len(os.sched_getaffinity(0)), "blocks": len(cpu.bindings)}


def stats(name, xs, nbytes=0):
    xs = xs or [0.0]                        # a path that never called it (the one-sequence decode fast path)
    res[f"{name}_us_mean"] = 1e6 * statistics.fmean(xs)
    res[f"{name}_us_p50"] = 1e6 * statistics.median(xs)
    if nbytes:
        res[f"{name}_gbs_mean"] = nbytes / (res[f"{name}_us_mean"] * 1e3)


if mode == "step":
    T = {"pre": [], "append": [], "attend": [], "post": []}

    decoding = [False]                      # only calls inside a decode step count (the prompt's do not)

    def timed(f, key):
        def g(*a, **kw):
            t = time.perf_counter()
            r = f(*a, **kw)
            if decoding[0]:
                T[key].append(time.perf_counter() - t)
            return r
        return g

    for d, key in ((cpu._pre, "pre"), (cpu._post, "post")):
        for k in list(d):
            d[k] = timed(d[k], key)
    for name in ("append", "attend"):
        setattr(cpu.kv, name, timed(getattr(cpu.kv, name), name))
    if cpu._decode_batch_for([cpu.kv]) is not None:            # the one-sequence fast path: its attention call
        batch = cpu._decode_batch_for([cpu.kv])
        batch.attend = timed(batch.attend, "attend")
    steps, inner = [], cpu.run_blocks

    def step(x, cos, sin, phase, *a, **kw):
        decoding[0] = phase == "decode"
        t = time.perf_counter()
        r = inner(x, cos, sin, phase, *a, **kw)
        if phase == "decode":
            steps.append(time.perf_counter() - t)
        decoding[0] = False
        return r

    cpu.run_blocks = step
    s.generate(prompt_ids=prompt, max_new_tokens=8, temperature=0.0, stop_at_eos=False)
    for v in T.values():
        v.clear()
    steps.clear()
    s.generate(prompt_ids=prompt, max_new_tokens=48, temperature=0.0, stop_at_eos=False)
    n = res["blocks"]
    stats("step", steps, n * (pre_bytes + post_bytes))
    stats("pre", T["pre"], pre_bytes)
    stats("post", T["post"], post_bytes)
    stats("append", T["append"])
    stats("attend", T["attend"])
    res["glue_us_per_block_mean"] = res["step_us_mean"] / n - sum(res[f"{k}_us_mean"] for k in T)
elif mode == "kernels":
    import re
    import tvm.runtime
    dev = tvm.cpu()
    exe = tvm.runtime.load_module(os.path.join(bundle, "cpu_stage.so"))   # the verified bundle's, loaded again
    lib, text = exe.imports[0], exe["as_text"]()
    use = [cpu.bindings[i] for i in range(min(12, len(cpu.bindings)))]

    def calls_of(fn):
        body = text[text.find(f"@{fn}:"):]
        body = body[:body.find("\n@", 5)]
        out = []
        for line in body.splitlines():
            m = re.match(r"\s*call\s+(\S+)\s+in:(.*?)dst:", line)
            if m and not m.group(1).startswith("vm.builtin"):
                out.append((m.group(1), [int(r) for r in re.findall(r"%(\d+)", m.group(2))]))
        return out

    def tensors_for(calls, nparams, params):
        """The intermediates' tensors, each shaped as its first kernel's signature says (TVM names the expected
        shapes in the error a wrong shape raises: one failing call per kernel tells them all)."""
        regs = {}
        for name, args in calls:
            f = lib.get_function(name)
            for r in args:
                if r >= nparams and r not in regs:
                    regs[r] = tvm.runtime.tensor(np.zeros((1, 1), np.float32), dev)
            try:
                f(*[params[r] if r < nparams else regs[r] for r in args])
            except ValueError as e:
                msg = re.sub(r"T\.int64\((\d+)\)", r"\1", str(e))
                sig = re.findall(r"\w+: Tensor\(\[([\d, ]+)\], (\w+)\)", msg)
                assert len(sig) == len(args), (name, str(e)[:300])
                for r, (shape, dt) in zip(args, sig):
                    if r >= nparams and tuple(regs[r].shape) != tuple(int(v) for v in shape.split(",")):
                        regs[r] = tvm.runtime.tensor(np.full([int(v) for v in shape.split(",")], 0.01, dt), dev)
                f(*[params[r] if r < nparams else regs[r] for r in args])
        return regs

    x = tvm.runtime.tensor(np.full((1, H), 0.01, np.float32), dev)
    attn = tvm.runtime.tensor(np.full((1, qd), 0.01, np.float32), dev)
    cs = tvm.runtime.tensor(np.ones((1, spec.head_dim), np.float32), dev)
    per = {}
    for fn, lead, part in (("post_attn_decode", [x, attn], "post"), ("pre_attn_decode", [x, cs, cs], "pre")):
        calls = calls_of(fn)
        nparams = len(lead) + len(use[0].post if part == "post" else use[0].pre)
        regs = tensors_for(calls, nparams, lead + (use[0].post if part == "post" else use[0].pre))
        funcs = [(name, lib.get_function(name), args) for name, args in calls]
        res[f"{part}_calls"] = [name for name, _ in calls]
        for variant in ("all", "gemv"):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for b in use:
                    params = lead + (b.post if part == "post" else b.pre)
                    for name, f, args in funcs:
                        if variant == "gemv" and "gemv" not in name:
                            continue
                        t = time.perf_counter()
                        f(*[params[r] if r < nparams else regs[r] for r in args])
                        per.setdefault(f"{part}:{name}", []).append(time.perf_counter() - t)
                times.append((time.perf_counter() - t0) / len(use))
            nbytes = post_bytes if part == "post" else pre_bytes
            res[f"{part}_{variant}_gbs_median"] = nbytes / statistics.median(times) / 1e9
        res[f"{part}_funcs"] = (funcs, regs, lead, nparams)
    # The profile's GEMV pass order: every GEMV of a block (q/k/v, o, gate/up, down), block after block; on the
    # weights as bound, then on copies in one arena filled with the profile's bytes (0x3c: fp16 1.06, no subnormals).
    from helmc.runtime.weights.host_memory import cpu_tensor_over, huge_page_buffer, tensor_bytes

    def kit_order(blocks):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for b in blocks:
                for part in ("pre", "post"):
                    funcs, regs, lead, nparams = res[f"{part}_funcs"]
                    params = lead + (b.post if part == "post" else b.pre)
                    for name, f, args in funcs:
                        if "gemv" in name:
                            f(*[params[r] if r < nparams else regs[r] for r in args])
            times.append((time.perf_counter() - t0) / len(blocks))
        return (pre_bytes + post_bytes) / statistics.median(times) / 1e9

    res["kit_order_gemv_gbs_median"] = kit_order(use)
    total = sum(sum(tensor_bytes(tuple(t.shape), str(t.dtype)) + 4096 for t in b.pre + b.post) for b in use)
    region, off, copies = huge_page_buffer(total, advise=False), 0, []
    region[:] = 0x3C
    for b in use:
        parts = []
        for ts in (b.pre, b.post):
            row = []
            for t in ts:
                nb = tensor_bytes(tuple(t.shape), str(t.dtype))
                row.append(cpu_tensor_over(region[off:off + nb], tuple(t.shape), str(t.dtype)))
                off += (nb + 4095) // 4096 * 4096
            parts.append(row)
        copies.append(st.StageBinding(pre=parts[0], post=parts[1]))
    res["kit_order_filled_gbs_median"] = kit_order(copies)
    del res["pre_funcs"], res["post_funcs"]
    res["kernel_us_median"] = {k: 1e6 * statistics.median(v) for k, v in per.items()}
else:
    import tvm.runtime
    from helmc.runtime.weights.host_memory import anon_huge_page_bytes, cpu_tensor_over, huge_page_buffer, tensor_bytes
    dev = tvm.cpu()
    use = list(range(min(12, len(cpu.bindings))))
    x = tvm.runtime.tensor(np.full((1, H), 0.01, np.float32), dev)
    attn = tvm.runtime.tensor(np.full((1, qd), 0.01, np.float32), dev)
    cs = tvm.runtime.tensor(np.ones((1, spec.head_dim), np.float32), dev)
    pre, post = cpu._pre[("decode", 0)], cpu._post[("decode", 0)]

    def rounds(bindings, label):
        for part, fn, args, nbytes in (("post", post, (x, attn), post_bytes), ("pre", pre, (x, cs, cs), pre_bytes)):
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for b in bindings:
                    fn(*args, *(b.post if part == "post" else b.pre))
                times.append((time.perf_counter() - t) / len(bindings))
            res[f"{label}_{part}_gbs_best"] = nbytes / min(times) / 1e9
            res[f"{label}_{part}_gbs_median"] = nbytes / statistics.median(times) / 1e9

    bound = [cpu.bindings[i] for i in use]
    rounds(bound, "bound")
    for advise in (False, True):
        total = sum(sum(tensor_bytes(tuple(t.shape), str(t.dtype)) + 4096 for t in b.pre + b.post) for b in bound)
        region, off, copies = huge_page_buffer(total, advise=advise), 0, []
        for b in bound:
            parts = []
            for ts in (b.pre, b.post):
                row = []
                for t in ts:
                    nb = tensor_bytes(tuple(t.shape), str(t.dtype))
                    c = cpu_tensor_over(region[off:off + nb], tuple(t.shape), str(t.dtype))
                    c.copyfrom(t)
                    row.append(c)
                    off += (nb + 4095) // 4096 * 4096
                parts.append(row)
            copies.append(st.StageBinding(pre=parts[0], post=parts[1]))
        label = "huge" if advise else "arena"
        res[f"{label}_anon_huge_bytes"] = anon_huge_page_bytes()
        rounds(copies, label)
        del copies, region
json.dump(res, open(out, "w"), indent=1)
print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()
               if k not in ("env", "kernel_us_median")))
for k, v in res.get("kernel_us_median", {}).items():
    print(f"  {k}: {v:.1f} us")
