"""Session 23, calls B and C: one loaded hybrid session decoding with several op orders in turn, so only the order
differs. Orders: old (session 22: every copy issued when its pair starts), prefetch (old + S_0 of the next token
queued after the last group), early (old + each next copy queued before the crossing back), new (both: this
session's token_ops), new_pinned (new, the crossing back through a pinned buffer instead of cupy.asnumpy);
call D adds old_pinned and prefetch_pinned, and the *_pinned orders take the resident part's logits through a pinned
buffer too (is a pageable device-to-host copy held up behind the prefetch's copy?); call E's --pinned-puts makes the
*_pinned orders also stage the host-to-device writes of a step (cos/sin, the activation, the GPU cache's step row)
through pinned buffers, asynchronously (is the host held up in begin() behind the prefetch's copy?).

    python ab_prefetch.py PROFILE BUNDLE WEIGHTS [--rounds 4] [--tokens 64] [--orders old,new]

Runs against commit 3421549 (the prefetch op and RingLender); the prefetch measured slower in every call and was
taken out again, so this script does not run on later commits.
"""
import argparse
import statistics
import sys

import numpy as np


def ops_of(num_pairs, prefetch: bool, early: bool):
    from helmc.runtime.hybrid.schedule import Op
    ops = [Op("begin"), Op("copy", 0)]
    for i in range(num_pairs):
        ops += [Op("cpu", i), Op("to_gpu", i), Op("wait_copy", i), Op("gpu", i), Op("release_ring", i)]
        if i + 1 < num_pairs:
            ops += [Op("copy", i + 1), Op("to_host", i)] if early else [Op("to_host", i), Op("copy", i + 1)]
    return tuple(ops + ([Op("prefetch", 0)] if prefetch else []) + [Op("resident"), Op("finish")])


class PinnedPuts:
    """Host -> device writes staged in pinned buffers, asynchronous on the given stream; each buffer reused only
    after an event says its last copy is done."""

    def __init__(self, slots=8):
        import cupy as cp
        import cupyx
        self.cp, self.cupyx, self.slots, self.rings = cp, cupyx, slots, {}

    def _stage(self, a):
        ring = self.rings.setdefault(a.nbytes, [])
        if len(ring) < self.slots:
            ring.append([self.cupyx.empty_pinned((a.nbytes,), np.uint8), self.cp.cuda.Event(disable_timing=True), False])
        slot = ring.pop(0)
        ring.append(slot)
        buf, ev, used = slot
        if used:
            ev.synchronize()
        view = buf.view(a.dtype).reshape(a.shape)
        np.copyto(view, a)
        slot[2] = True
        return view, ev

    def put(self, dst, host):
        a = np.ascontiguousarray(host, dst.dtype).reshape(dst.shape)
        view, ev = self._stage(a)
        st = self.cp.cuda.get_current_stream()
        dst.set(view, stream=st)
        ev.record(st)

    def write(self, dst, values, stream):
        view, ev = self._stage(np.ascontiguousarray(values))
        self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, view.ctypes.data, view.nbytes, 1, stream.ptr)
        ev.record(stream)


def pinned_get():
    import cupy as cp
    import cupyx
    bufs = {}

    def get(dev):
        key = (dev.shape, dev.dtype.str)
        if key not in bufs:
            bufs[key] = cupyx.empty_pinned(dev.shape, dev.dtype)
        dev.get(out=bufs[key], stream=cp.cuda.get_current_stream(), blocking=True)
        return bufs[key].copy()
    return get


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile"); ap.add_argument("bundle"); ap.add_argument("weights")
    ap.add_argument("--rounds", type=int, default=4); ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--orders", default="old,prefetch,early,new,new_pinned")
    ap.add_argument("--pinned-logits", action="store_true", help="the *_pinned orders also take the logits pinned")
    ap.add_argument("--pinned-puts", action="store_true", help="the *_pinned orders also stage host->device writes")
    a = ap.parse_args()
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.session import Session
    plan = replan_bundle(a.bundle, a.profile)[0]
    s = Session.load(a.bundle, weights_dir=a.weights, plan=plan)
    h = s.gpu.hybrid
    m_pairs = len(h.schedule.pairs)
    assert h.schedule.ops == ops_of(m_pairs, True, True)
    orders = {"old": (ops_of(m_pairs, False, False), False), "prefetch": (ops_of(m_pairs, True, False), False),
              "early": (ops_of(m_pairs, False, True), False), "new": (ops_of(m_pairs, True, True), False),
              "new_pinned": (ops_of(m_pairs, True, True), True), "old_pinned": (ops_of(m_pairs, False, False), True),
              "prefetch_pinned": (ops_of(m_pairs, True, False), True)}
    import cupy as cp
    import helmc.runtime.gpu_session as gs
    plain_logits = gs.logits_out

    def pinned_logits(logits, argmax):
        return plain_logits(logits, argmax) if argmax else fast_get(cp.ascontiguousarray(logits))
    names = a.orders.split(",")
    plain_get, fast_get = h.backend.arrays.get, pinned_get()
    puts = PinnedPuts()
    plain_put, kv_ops = h.backend.arrays.put, h.backend.gpu_kv.ops
    plain_write = kv_ops.write
    prompt = np.random.default_rng(0).integers(3, s.spec.vocab_size, 128).tolist()
    res, toks = {n: [] for n in names}, {}
    for r in range(a.rounds + 1):
        for name in names:
            ops, pinned = orders[name]
            object.__setattr__(h.schedule, "ops", ops)     # the experiment's change: the order of the ops
            h.backend.arrays.get = fast_get if pinned else plain_get
            gs.logits_out = pinned_logits if pinned and a.pinned_logits else plain_logits
            h.backend.arrays.put = puts.put if pinned and a.pinned_puts else plain_put
            kv_ops.write = puts.write if pinned and a.pinned_puts else plain_write
            h.backend.forget_prefetch()
            g = s.generate(prompt_ids=prompt, max_new_tokens=a.tokens, temperature=0.0, stop_at_eos=False)
            if r:                                          # round 0 warms up every order
                res[name].append(statistics.median(g.per_token_ms))
            toks[name] = list(g.tokens)
    m = {k: statistics.median(v) for k, v in res.items()}
    print(f"{a.bundle}: {plan.describe()}, T_plan {plan.t_plan_ms:.2f} ms")
    for name in names:
        print(f"  {name:<10} {m[name]:7.2f} ms/token  old/this {m[names[0]] / m[name]:.3f}  "
              f"rounds {['%.2f' % x for x in res[name]]}  same tokens {toks[name] == toks[names[0]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
