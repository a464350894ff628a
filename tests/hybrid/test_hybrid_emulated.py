"""Hybrid decode's executor and its CUDA backend, run on the CPU.

The real HybridDecode and CudaHybridBackend run on tests/kv_device_emulator.EmulatedOps: streams, events and
copies are NumPy with a race detector (a copy into the ring without waiting for the last group's reads, or a
streamed block reading its slot before its copy's event, fails), the GPU cache is the real KVCacheGPU, the stages
are real Stages (kv_base, CPU groups run a block range) over a fake VM whose blocks are small attention blocks in
NumPy. Each block has its own weights, so a wrong ring slot or a stale copy gives other logits: the tokens' logits
must match a float64 model of the same blocks run in order. Also: the call order a backend sees, exactly.
"""
import numpy as np
import pytest

from helmc.runtime.bundle.plan import Plan, PlanGroup
from helmc.runtime.hybrid.cuda_backend import CudaHybridBackend
from helmc.runtime.hybrid.executor import HybridDecode
from helmc.runtime.hybrid.schedule import ARENA_ALIGN, aligned, schedule_of
from helmc.runtime.kv.cache_cpu import KVCacheCPU
from helmc.runtime.kv.cache_gpu import KVCacheGPU
from helmc.runtime.stage import Stage, StageBinding
from kv_device_emulator import EmulatedOps, RaceError
from qwen3_configs import qwen3_spec

L, H, D, HA, HKV, V = 6, 32, 8, 4, 2, 40
BATCHES = (2, 4)                        # the batched decode variants the fake VM and the stages hold
QD, KVD = HA * D, HKV * D


@pytest.fixture(scope="module")
def spec():
    return qwen3_spec("Qwen3-8B", num_hidden_layers=L, hidden_size=H, head_dim=D, num_attention_heads=HA,
                      num_key_value_heads=HKV, intermediate_size=64, vocab_size=V)


def plan_of(pairs) -> Plan:
    groups, first = [], 0
    for c, s in pairs:
        groups += [PlanGroup("cpu", first, c, c), PlanGroup("streamed", first + c, s, s)]
        first += c + s
    return Plan.of(num_layers=L, cpu_units=first + 1, max_context=64,
                groups=tuple(groups), staging_ring_bytes=max(s for _, s in pairs))


class Arena:
    """A block's weights [H, QD + 2 KVD] and [QD, H] float32 in one pinned buffer, as PinnedBlockArena lays out."""
    SHAPES = ((H, QD + 2 * KVD), (QD, H))

    def __init__(self, ops, layer, rng):
        self.layer = layer
        self.nbytes = sum(aligned(int(np.prod(s)) * 4) for s in self.SHAPES)
        self.host = ops.pinned_empty((self.nbytes // 4,), np.float32).view(np.uint8)     # [bytes / 4] -> [bytes]
        self.weights = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in self.SHAPES]
        for w, view in zip(self.weights, views(self.host)):
            view[...] = w

    def binding(self, buf=None):
        return StageBinding(*([w] for w in views(self.host if buf is None else buf)))


def views(buf):
    out, off = [], 0
    for s in Arena.SHAPES:
        n = int(np.prod(s)) * 4
        out.append(np.ndarray.__getitem__(buf, slice(off, off + n)).view(np.float32).reshape(s))
        off += aligned(n)
    return out


class FakeVM(dict):
    """pre_attn / post_attn of a tiny attention block in NumPy; the GPU's return fp16, as the compiled ones do."""

    def __init__(self, ops, gpu):
        def pre(x, cos, sin, w):
            ops.access(ops.current_stream(), w, write=False)        # a kernel reading its weights (ring or VRAM)
            y = np.asarray(x, np.float32) @ np.asarray(w) * (1 + cos[:, :1] - sin[:, :1])   # each row its angle
            return y[:, :QD], y[:, QD:QD + KVD], y[:, QD + KVD:]

        def post(x, attn, w):
            ops.access(ops.current_stream(), w, write=False)
            out = np.asarray(x, np.float32) + np.asarray(attn, np.float32) @ np.asarray(w)
            return out.astype(np.float16 if gpu else np.float32)

        super().__init__({f"{p}_{ph}": f for p, f in (("pre_attn", pre), ("post_attn", post))
                          for ph in ("prefill", "decode") + tuple(f"decode_b{b}" for b in BATCHES)})


class NumpyArrays:
    def __init__(self, ops):
        self.ops = ops

    def put(self, dst, host):
        self.ops.access(self.ops.current_stream(), dst, write=True)
        np.ndarray.__setitem__(dst, Ellipsis, np.asarray(host, dst.dtype).reshape(dst.shape))

    def get(self, dev):
        self.ops.synchronize_stream(self.ops.current_stream())
        return np.array(dev)

    def copy(self, dst, src):
        self.put(dst, np.asarray(src))

    def device(self, host):
        dst = self.ops.device_empty(host.shape, host.dtype)
        self.put(dst, host)
        return dst

    host_tensor = host_array = staticmethod(lambda a: a)


def build(spec, pairs, seed=0):
    from helmc.runtime.gpu_session import gpu_cache_windows
    ops, rng = EmulatedOps(num_sms=2), np.random.default_rng(seed)
    arenas = {i: Arena(ops, i, rng) for i in range(L)}
    lm = rng.standard_normal((H, V)).astype(np.float32)
    plan = plan_of(pairs)
    s = schedule_of(plan, lambda layer: arenas[layer].nbytes)
    ring = ops.device_empty((s.ring_bytes // 4,), np.float32).view(np.uint8)
    # each cache layer its block's window, as the session makes them (gemma_like: sliding blocks beside global ones)
    gpu_kv = KVCacheGPU(len(s.gpu_kv_layers), HKV, D, page_tokens=4, max_tokens=64, ops=ops, staging_pages=2,
                        sliding_window=gpu_cache_windows(spec, plan.placement))
    ident = lambda a: a                                                        # noqa: E731
    vm_gpu, vm_cpu = FakeVM(ops, gpu=True), FakeVM(ops, gpu=False)
    streamed = [Stage(f"s{p.index}", vm_gpu, spec, range(p.slots[0].layer, p.slots[-1].layer + 1), gpu_kv,
                      [arenas[sl.layer].binding(ring[sl.offset:sl.offset + sl.nbytes]) for sl in p.slots], ident,
                      ident, batch_sizes=BATCHES, kv_base=p.gpu_kv_base) for p in s.pairs]
    cpu_stage = Stage("cpu", vm_cpu, spec, s.cpu_layers, KVCacheCPU(len(s.cpu_layers), HKV, D, page_tokens=4,
                      max_tokens=64, sliding_window=tuple(spec.layer_window(i) for i in s.cpu_layers)),
                      [arenas[i].binding() for i in s.cpu_layers], ident, ident, batch_sizes=BATCHES)
    vram = {}
    for i in s.resident_layers:                                               # resident weights live in VRAM
        vram[i] = ops.device_empty((arenas[i].nbytes // 4,), np.float32).view(np.uint8)
        np.ndarray.__setitem__(vram[i], Ellipsis, arenas[i].host)
    resident_stage = Stage("gpu", vm_gpu, spec, s.resident_layers, gpu_kv,
                           [arenas[i].binding(vram[i]) for i in s.resident_layers], ident, ident,
                           batch_sizes=BATCHES, kv_base=len(s.streamed_layers))

    def resident(x, cos, sin):
        x = resident_stage.run_blocks(x, cos, sin, "decode")
        gpu_kv.advance(1)
        return np.asarray(x, np.float32) @ lm

    backend = CudaHybridBackend(s, {i: arenas[i] for i in s.streamed_layers}, ring, streamed, cpu_stage, gpu_kv,
                                resident, spec, ident, ident, ops=ops, arrays=NumpyArrays(ops))
    backend.resident_stage = resident_stage            # for the batched twin (test_batched_hybrid_...)
    return HybridDecode(s, backend), arenas, lm


def reference(arenas, lm, xs, angles, spec=None, local_angles=None):
    """The same blocks in order, float64, attention over every earlier token; with a `spec` of sliding blocks beside
    global ones, each block over its own window (ModelSpec.layer_window) at its own RoPE angle (local_angles for the
    blocks of the local table)."""
    kv = {i: ([], []) for i in range(L)}
    out = []
    for t, (x, a) in enumerate(zip(xs, angles)):
        x = x.astype(np.float64)
        for i in range(L):
            w, wo = (w.astype(np.float64) for w in arenas[i].weights)
            ang = local_angles[t] if spec is not None and spec.layer_rope_local(i) else a
            y = x @ w * (1 + np.cos(ang) - np.sin(ang))
            q, k, v = y[:, :QD].reshape(HA, D), y[:, QD:QD + KVD].reshape(HKV, D), y[:, QD + KVD:].reshape(HKV, D)
            kv[i][0].append(k)
            kv[i][1].append(v)
            K, Vv = np.stack(kv[i][0], 1), np.stack(kv[i][1], 1)              # [h_kv, t, d]
            window = spec.layer_window(i) if spec is not None else 0
            if window:
                K, Vv = K[:, -window:], Vv[:, -window:]                        # its last `window` tokens
            K, Vv = np.repeat(K, HA // HKV, 0), np.repeat(Vv, HA // HKV, 0)   # [h_a, t, d]
            e = np.einsum("hd,htd->ht", q, K) / np.sqrt(D)
            p = np.exp(e - e.max(-1, keepdims=True))
            o = np.einsum("ht,htd->hd", p / p.sum(-1, keepdims=True), Vv)
            x = x + o.reshape(1, QD) @ wo
        out.append(x @ lm)
    return out


def run_tokens(decode, n, seed=1):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((1, H)).astype(np.float32) for _ in range(n)]
    angles = rng.uniform(0, 0.5, n)
    got = [decode.step(x, np.full((1, D), np.cos(a), np.float32), np.full((1, D), np.sin(a), np.float32))
           for x, a in zip(xs, angles)]
    return xs, angles, got


def gemma_like(spec):
    """`spec` with Gemma 3's attention: blocks 2 and 5 global, the others over a window of 3 tokens with a RoPE
    table of their own (RopeTables' rows [global D | local D])."""
    import dataclasses

    from helmc.model.spec import RopeSpec
    return dataclasses.replace(spec, sliding_window=3, global_layers=(2, 5), local_rope=RopeSpec(theta=10000.0))


@pytest.mark.parametrize("pairs", [((1, 2), (1, 1)), ((2, 1),), ((1, 1), (1, 1), (1, 1))])
def test_sliding_and_global_blocks_keep_their_window_and_rope_table(spec, pairs):
    """Gemma 3 decoded hybrid: each block, CPU, streamed or resident, attends over its own window and takes its own
    half of the step's RoPE row, whichever group it is in; 9 tokens pass the window of 3 three times."""
    g = gemma_like(spec)
    decode, arenas, lm = build(g, pairs)
    rng = np.random.default_rng(1)
    n = 9
    xs = [rng.standard_normal((1, H)).astype(np.float32) for _ in range(n)]
    angles, local = rng.uniform(0, 0.5, n), rng.uniform(0.5, 1.0, n)
    row = lambda f, t: np.concatenate([np.full((1, D), f(angles[t])), np.full((1, D), f(local[t]))], 1)  # noqa: E731
    got = [decode.step(xs[t], row(np.cos, t).astype(np.float32), row(np.sin, t).astype(np.float32)) for t in range(n)]
    want = reference(arenas, lm, xs, angles, g, local)
    err = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, want))
    print(f"{decode.schedule.describe()}: max relative error {err:.2e} over {n} tokens")
    assert err < 2e-2
    # what the check tells apart: every block global on one table, or every block on the local table
    for other in (reference(arenas, lm, xs, angles), reference(arenas, lm, xs, local)):
        assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(other, want)) > 0.1
    assert decode.backend.gpu_kv.windows == tuple(g.layer_window(i) for i in decode.schedule.gpu_kv_layers)


@pytest.mark.parametrize("pairs", [((1, 2), (1, 1)), ((2, 1),), ((1, 1), (1, 1), (1, 1)), ((1, 3), (1, 1))])
def test_hybrid_tokens_match_the_blocks_in_order(spec, pairs):
    decode, arenas, lm = build(spec, pairs)
    xs, angles, got = run_tokens(decode, 9)                                  # 9 tokens: three KV pages of 4
    want = reference(arenas, lm, xs, angles)
    err = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))
    print(f"{decode.schedule.describe()}: max relative error {err:.2e} over {len(got)} tokens")
    assert err < 2e-2                                   # fp16 activations and KV on the "GPU"; a wrong slot is O(1)
    b = decode.backend
    assert b.bytes_copied == 9 * sum(p.copy_bytes for p in decode.schedule.pairs)
    assert b.gpu_kv.length == b.cpu_stage.kv.length == 9


def test_a_stale_ring_slot_is_a_wrong_token(spec):
    # The check above would catch a slot mix-up: swapping two streamed blocks' slots changes the logits.
    decode, arenas, lm = build(spec, ((1, 2), (1, 1)))
    st = decode.backend.stages[0]
    st.bindings[0], st.bindings[1] = st.bindings[1], st.bindings[0]
    xs, angles, got = run_tokens(decode, 3)
    want = reference(arenas, lm, xs, angles)
    assert max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want)) > 0.1


def test_a_copy_that_does_not_wait_for_the_rings_readers_is_a_race(spec):
    decode, *_ = build(spec, ((1, 1), (1, 1)))
    b = decode.backend
    b.ring_read = False
    b.release_ring = lambda p: None                     # ring_free never recorded: no copy waits for the readers
    # Within a token the host's wait for the activation (to_host) already orders pair 1's copy after pair 0's
    # kernels; the next token's first copy follows the last group with no host wait between them (the emulated
    # head returns without one), so only ring_free orders it.
    with pytest.raises(RaceError):
        run_tokens(decode, 2)


def test_a_group_that_does_not_wait_for_its_copy_is_a_race(spec):
    decode, *_ = build(spec, ((1, 1), (1, 1)))
    decode.backend.wait_copy = lambda p: None
    with pytest.raises(RaceError):
        run_tokens(decode, 1)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("pairs", [((1, 2), (1, 1)), ((2, 1),), ((1, 1), (1, 1), (1, 1))])
def test_batched_hybrid_steps_serve_each_sequence_as_alone(spec, pairs, gemma):
    """Serving a hybrid plan: steps of several sequences through the same schedule
    (runtime/hybrid/batch.py), each on caches of its own, a third sequence joining late and the batch padded to
    the compiled sizes (2, 4): every sequence's logits match the blocks run in order for it alone, and each
    streamed group crosses once per step whatever the number of sequences. gemma: sliding blocks beside global
    ones (gemma_like), each sequence's row [global D | local D] at angles of its own."""
    from helmc.runtime.hybrid.batch import BatchHybridBackend
    from helmc.runtime.gpu_session import gpu_cache_windows
    spec = gemma_like(spec) if gemma else spec
    decode, arenas, lm = build(spec, pairs)
    base, s = decode.backend, decode.schedule
    ops = base.ops
    batched = HybridDecode(s, BatchHybridBackend(base, base.resident_stage,
                                                 {p: (lambda x, w: np.asarray(x, np.float32) @ w)
                                                  for p in ("decode",) + tuple(f"decode_b{b}" for b in BATCHES)},
                                                 [lm]))
    caches = [(KVCacheCPU(len(s.cpu_layers), HKV, D, page_tokens=4, max_tokens=64,
                          sliding_window=tuple(spec.layer_window(i) for i in s.cpu_layers)),
               KVCacheGPU(len(s.gpu_kv_layers), HKV, D, page_tokens=4, max_tokens=64, ops=ops, staging_pages=2,
                          sliding_window=gpu_cache_windows(spec, plan_of(pairs).placement)))
              for _ in range(3)]
    # The fake blocks have no norms: on some draws their fp16 activations overflow or their attention scores near-tie,
    # and a logit then differs past the tolerance whatever the cache (seeds 3 and 8 do so here with no window at all).
    rng = np.random.default_rng(9 if gemma else 7)
    steps, joins = 9, (0, 0, 4)                          # sequence 2 joins at step 4
    # Inputs at 0.3: the fake blocks' fp16 outputs overflow on some full-scale draws (inf), which says nothing here.
    xs = [[(0.3 * rng.standard_normal((1, H))).astype(np.float32) for _ in range(steps - j)] for j in joins]
    angles = [rng.uniform(0, 0.5, steps - j) for j in joins]
    local = [rng.uniform(0.5, 1.0, steps - j) for j in joins]                  # the local table's (gemma)
    got = [[] for _ in joins]
    for t in range(steps):
        live = [b for b, j in enumerate(joins) if t >= j]
        padded = next(n for n in (1,) + BATCHES if n >= len(live))
        pad = padded - len(live)
        x = np.concatenate([xs[b][t - joins[b]] for b in live] + [np.zeros((pad, H), np.float32)])   # [padded, H]
        a = np.concatenate([[angles[b][t - joins[b]] for b in live], np.zeros(pad)])                   # [padded]
        batched.backend.bind([caches[b][0] for b in live], [caches[b][1] for b in live], [1] * len(live))
        cos = np.repeat(np.cos(a)[:, None], D, 1).astype(np.float32)                                   # [padded, D]
        sin = np.repeat(np.sin(a)[:, None], D, 1).astype(np.float32)                                   # [padded, D]
        if gemma:                                                                      # [padded, D] -> [padded, 2D]
            al = np.concatenate([[local[b][t - joins[b]] for b in live], np.zeros(pad)])
            cos = np.concatenate([cos, np.repeat(np.cos(al)[:, None], D, 1).astype(np.float32)], 1)
            sin = np.concatenate([sin, np.repeat(np.sin(al)[:, None], D, 1).astype(np.float32)], 1)
        logits = batched.step(x, cos, sin)                                                             # [B, V]
        assert logits.shape == (len(live), V)
        for b, row in zip(live, logits):
            got[b].append(row[None])
    for b in range(len(joins)):
        want = reference(arenas, lm, xs[b], angles[b], spec if gemma else None, local[b])
        err = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got[b], want))
        print(f"{s.describe()}{' (gemma)' if gemma else ''}: sequence {b}: max relative error {err:.2e} over {len(got[b])} tokens")
        assert err < 2e-2
        assert caches[b][0].length == caches[b][1].length == steps - joins[b]
    assert base.bytes_copied == steps * sum(p.copy_bytes for p in s.pairs)    # once per step, not per sequence


class Recorder:
    """A backend that logs every call: the executor's contract, op by op."""

    def __init__(self):
        self.log = []

    def __getattr__(self, name):
        def op(*args):
            self.log.append((name, *(a.index for a in args if hasattr(a, "index") and not isinstance(a, str))))
            if name in ("cpu", "gpu"):
                return args[1] + 1
            if name in ("to_gpu", "to_host"):
                return args[0] * 10
            return "logits" if name == "resident" else None
        return op


def test_executor_calls_each_op_in_order_and_moves_the_activation():
    s = schedule_of(plan_of(((1, 2), (1, 1))), lambda layer: ARENA_ALIGN)
    rec = Recorder()
    assert HybridDecode(s, rec).step(0, "cos", "sin") == "logits"
    assert rec.log == [("begin",), ("copy", 0), ("cpu", 0), ("to_gpu",), ("wait_copy", 0), ("gpu", 0),
                       ("release_ring", 0), ("to_host",), ("copy", 1), ("cpu", 1), ("to_gpu",), ("wait_copy", 1),
                       ("gpu", 1), ("release_ring", 1), ("resident",), ("finish",)]
