"""Checks shared by tests/runtime/test_paged_attention_gpu.py, tests/runtime/test_kv_cache_gpu_emulated.py and
benchmarks/bench_kv_cache.py. No pytest here: the GPU machine may run them without it."""
import os

import numpy as np

from helmc.runtime.kv.paged_attention import ListPageSource, full_attention, streaming_attention_decode


def prebuilt_cuda_ops(cp, shapes):
    """CudaOps with the paged attention kernels compiled here by nvcc for each (head_dim, group) and this GPU's
    arch, as `helmc build` compiles them into a bundle (the runtime itself never compiles CUDA)."""
    import tempfile

    from helmc.compiler.passes.compile_gpu_stage import compile_paged_attention
    from helmc.runtime.kv.cuda_ops import CudaOps
    arch = f"sm_{cp.cuda.Device().compute_capability}"
    cubins = {}
    for d, group in shapes:
        out = tempfile.mkdtemp(prefix=f"helmc-pa-d{d}g{group}-")
        cubins[(d, group)] = os.path.join(out, compile_paged_attention(d, group, arch, out))
    return CudaOps(cubins)


def _reference(q, pages, scale, sinks):
    """Algorithm 3 in float64 over pages [(k, v) [h_kv, n_i, d]] in order; with sinks [h_a], full_attention's."""
    if sinks is None:
        return streaming_attention_decode(q.astype(np.float64), ListPageSource(pages), scale)
    k, v = (np.concatenate([p[w] for p in pages], axis=1).transpose(1, 0, 2) for w in (0, 1))   # -> [n, h_kv, d]
    return full_attention(q[None], k, v, scale, sinks=sinks)[0]


def kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens, seed=0, pages_per_split=1, sinks=None):
    """Run the two decode kernels over pages in shuffled pool slots (sinks [h_a] fp32 to the merge, or None);
    return (rel err, output); with sinks, paged_decode_fused's output must equal the merge's bit for bit."""
    ops = prebuilt_cuda_ops(cp, [(d, group)])
    rng = np.random.default_rng(seed)
    n_pages = -(-n_tokens // page_tokens)
    pool = rng.standard_normal((n_pages + 3, 2, h_kv, page_tokens, d)).astype(np.float16)
    slots = rng.permutation(n_pages + 3)[:n_pages]            # logical page i lives in slot slots[i]
    q = (rng.standard_normal((h_kv * group, d)) * 2).astype(np.float16)
    dpool = cp.asarray(pool)
    ptrs = cp.asarray(np.array([dpool.data.ptr + int(s) * pool[0].nbytes for s in slots], np.int64))
    n_splits = -(-n_pages // pages_per_split)
    rows = n_splits * h_kv * group
    pm, ps, po = cp.empty(rows, np.float32), cp.empty(rows, np.float32), cp.empty(rows * d, np.float32)
    out = cp.empty((h_kv * group, d), np.float16)
    scale = 1 / np.sqrt(d)
    step = cp.asarray(np.array([n_tokens, 0], np.int32))
    ops.decode_partial(cp.asarray(q), ptrs, page_tokens, step, pages_per_split * page_tokens, 0, n_splits, h_kv, d, scale,
                       pm, ps, po)
    sinks_dev = None if sinks is None else cp.asarray(sinks)
    ops.decode_merge(pm, ps, po, 0, n_splits, h_kv * group, d, group, out, sinks_dev)
    if sinks is not None:
        fused = cp.empty_like(out)
        ops.decode_fused(cp.asarray(q), ptrs, page_tokens, step, pages_per_split * page_tokens, 0, n_splits, h_kv, d,
                         scale, pm, ps, po, cp.zeros(h_kv, np.int32), fused, sinks_dev)
        assert cp.array_equal(fused.view(cp.uint16), out.view(cp.uint16)), "fused decode differs from the merge"
    got = cp.asnumpy(out).astype(np.float64)                  # fp16 output: relative rounding up to 2^-11
    pages = []
    for i, s in enumerate(slots):
        n_i = min(page_tokens, n_tokens - i * page_tokens)
        pages.append((pool[s, 0, :, :n_i].astype(np.float64), pool[s, 1, :, :n_i].astype(np.float64)))
    ref = _reference(q, pages, scale, sinks)
    return float(np.abs(got - ref).max() / np.abs(ref).max()), got


def short_kernel_vs_reference(cp, h_kv, group, d, page_tokens, n_tokens, seed=0, sinks=None):
    """paged_decode_short_append over pages in shuffled pool slots, the step's row (token n-1) from k, v, sinks [h_a]
    fp32 or None: (rel err against Algorithm 3 -- full_attention with sinks -- over the pages with that row written,
    whether the kernel wrote it)."""
    ops = prebuilt_cuda_ops(cp, [(d, group)])
    rng = np.random.default_rng(seed)
    n_pages = -(-n_tokens // page_tokens)
    pool = rng.standard_normal((n_pages + 3, 2, h_kv, page_tokens, d)).astype(np.float16)
    slots = rng.permutation(n_pages + 3)[:n_pages]
    q = (rng.standard_normal((h_kv * group, d)) * 2).astype(np.float16)
    k, v = (rng.standard_normal((h_kv, d)).astype(np.float16) for _ in range(2))
    dpool = cp.asarray(pool)
    ptrs = cp.asarray(np.array([dpool.data.ptr + int(s) * pool[0].nbytes for s in slots], np.int64))
    out = cp.empty((h_kv * group, d), np.float16)
    scale = 1 / np.sqrt(d)
    step = cp.asarray(np.array([n_tokens, 0], np.int32))
    ops.decode_short_append(cp.asarray(q), cp.asarray(k), cp.asarray(v), ptrs, page_tokens, step, h_kv, d, scale, out,
                            None if sinks is None else cp.asarray(sinks))
    got = cp.asnumpy(out).astype(np.float64)
    page, row = divmod(n_tokens - 1, page_tokens)
    pool[slots[page], 0, :, row], pool[slots[page], 1, :, row] = k, v
    written = bool(np.array_equal(cp.asnumpy(dpool), pool))
    pages = []
    for i, s in enumerate(slots):
        n_i = min(page_tokens, n_tokens - i * page_tokens)
        pages.append((pool[s, 0, :, :n_i].astype(np.float64), pool[s, 1, :, :n_i].astype(np.float64)))
    ref = _reference(q, pages, scale, sinks)
    return float(np.abs(got - ref).max() / np.abs(ref).max()), written


def drive(cp, caches, steps, seed, h_kv, group, d, sinks=None):
    """Feed identical fp16 rows to every cache (CuPy); return (max relative error vs full softmax, with sinks[layer]
    in its denominator where given, whether every decode output was bitwise equal across caches)."""
    rng = np.random.default_rng(seed)
    hist = [[np.zeros((0, h_kv, d), np.float16)] * 2 for _ in range(caches[0].L)]
    worst, identical = 0.0, True
    for S in steps:
        for layer in range(caches[0].L):
            k, v = rng.standard_normal((2, S, h_kv, d)).astype(np.float16)
            q = rng.standard_normal((S, h_kv * group, d)).astype(np.float16)
            outs = []
            for c in caches:
                c.append(layer, cp.asarray(k), cp.asarray(v))
                outs.append(cp.asnumpy(c.attend(layer, cp.asarray(q), 1 / np.sqrt(d))))
            hist[layer] = [np.concatenate([hist[layer][0], k]), np.concatenate([hist[layer][1], v])]
            ref = full_attention(q, hist[layer][0], hist[layer][1], 1 / np.sqrt(d),
                                 sinks=None if sinks is None else sinks[layer])
            for o in outs:
                worst = max(worst, float(np.abs(o - ref).max() / np.abs(ref).max()))
            if S == 1:
                identical &= all(np.array_equal(outs[0], o) for o in outs[1:])
        for c in caches:
            c.advance(S)
    cp.cuda.Device().synchronize()
    return worst, identical


def check_round_trip(c, to_device, sync):
    rng = np.random.default_rng(5)
    k, v = rng.standard_normal((2, 2, 80, 2, 64)).astype(np.float16)   # [layer, token, h_kv, d] each
    pos = 0
    for S in (16, 16, 8, 40):
        for layer in range(2):
            c.append(layer, to_device(k[layer, pos:pos + S]), to_device(v[layer, pos:pos + S]))
        c.advance(S)
        pos += S
    sync()
    t = c.pool.page_table(c._seq)
    host_pages = [i for i in range(t.n_pages) if t.host_slots[i] is not None]
    assert host_pages == [0, 1, 2, 3]
    for i in host_pages:
        e, j = divmod(t.host_slots[i], c.extent_pages)
        page = c._extents[e][j]                                # [L, 2, h_kv, T, d] pinned
        rows = slice(i * 16, (i + 1) * 16)
        for layer in range(2):
            assert np.array_equal(page[layer, 0], k[layer, rows].transpose(1, 0, 2))   # [T,h_kv,d] -> [h_kv,T,d]
            assert np.array_equal(page[layer, 1], v[layer, rows].transpose(1, 0, 2))
