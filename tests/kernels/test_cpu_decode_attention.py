"""The CPU stage's compiled decode-attention kernel (schedules/cpu/decode_attention.py) and its use by KVCacheCPU.

1. The kernel, compiled for AVX2, against float64 NumPy softmax attention on random fp16 / bf16 KV: GQA ratios
   1, 3, 4, 8 (tiny heads) and Qwen3-8B's layer (32 query heads, 8 KV heads, d 128); n in {1, 7, 300, 5000} rows
   starting at row0 > 0 of a larger arena (5000 rows take several splits and a partial last chunk).
   Tolerance: relative error (max |diff| / max |ref|) <= 1e-3; fp32 accumulation lands near 1e-6.
2. KVCacheCPU with the kernel equals KVCacheCPU without it (its NumPy path) over a prefill and decode steps,
   with and without a sliding window, for fp16 and bf16 storage.
3. The kernel ships in a compiled Relax executable and find_decode_kernel finds it there by name (and
   returns None where it is absent, as for bundles built before it existed).
No stored references: NumPy recomputes them on every run.
"""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from helmc.runtime.kv.cache_cpu import KVCacheCPU, bf16_bits, find_decode_kernel  # noqa: E402
from helmc.runtime.kv.paged_attention import full_attention  # noqa: E402
from helmc.compiler.passes.schedule_cpu_stage import llvm_target  # noqa: E402
from helmc.schedules.cpu.decode_attention import make_decode_attention  # noqa: E402
from helmc.schedules.cpu.isa import missing_flags, select_isa  # noqa: E402

AVX2 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
HOST = tuple(next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), ()))
pytestmark = pytest.mark.skipif(missing_flags(AVX2, HOST) != (), reason="this CPU lacks AVX2/FMA/F16C")

# (h_a, h_kv, d): GQA 1, 4 and 8 on tiny heads, GQA 3 (its score blocks of 2 rows x 3 heads leave 2 of the 8
# lane-tree inputs empty), then Qwen3-8B's layer shape.
SHAPES = [(2, 2, 16), (8, 2, 16), (8, 1, 32), (6, 2, 16), (32, 8, 128)]
DTYPES = ("float16", "bfloat16")
ROW0 = 13
ARENA_ROWS = ROW0 + 5000 + 3


@pytest.fixture(scope="module")
def kernels():
    """Every (shape, dtype) kernel, compiled once into one library for this machine's AVX2."""
    isa = select_isa(AVX2)
    funcs = {}
    for h_a, h_kv, d in SHAPES:
        for dtype in DTYPES:
            f = make_decode_attention(h_a, h_kv, d, dtype, isa, max_splits=4)
            funcs[(h_a, h_kv, d, dtype)] = f
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(str(f.attrs["global_symbol"])): f for f in funcs.values()}),
                      target=llvm_target(AVX2))
    return {key: lib[str(f.attrs["global_symbol"])] for key, f in funcs.items()}


def stored(rng, shape, dtype):
    """(arena-dtype array, float64 copy of exactly the values the kernel reads)."""
    vals = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        bits = bf16_bits(vals)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    half = vals.astype(np.float16)
    return half, half.astype(np.float64)


def aligned(a: np.ndarray) -> np.ndarray:
    """Copy on a 64-byte boundary (zero-copy TVM tensors require it)."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}_kv{s[1]}_d{s[2]}")
def test_kernel_matches_float64_reference(kernels, shape, dtype):
    h_a, h_kv, d = shape
    g = h_a // h_kv
    rng = np.random.default_rng(h_a * 100 + d)
    k, k64 = stored(rng, (h_kv, ARENA_ROWS, d), dtype)
    v, v64 = stored(rng, (h_kv, ARENA_ROWS, d), dtype)
    q = aligned(rng.standard_normal((h_a, d), dtype=np.float32))
    o = aligned(np.zeros((h_a, d), np.float32))
    k, v = aligned(k), aligned(v)
    args = [tvm.runtime.from_dlpack(a) for a in (q, k, v)]
    scale = 1.0 / np.sqrt(d)
    worst = 0.0
    for n in (1, 7, 300, 5000):
        kernels[(h_a, h_kv, d, dtype)](*args, ROW0, n, scale, tvm.runtime.from_dlpack(o))
        rows = slice(ROW0, ROW0 + n)
        qg = q.reshape(h_kv, g, d).astype(np.float64)                     # [h_a, d] -> [h_kv, g, d]
        e = np.einsum("hgd,hnd->hgn", qg, k64[:, rows]) * scale
        p = np.exp(e - e.max(-1, keepdims=True))
        ref = np.einsum("hgn,hnd->hgd", p / p.sum(-1, keepdims=True), v64[:, rows])
        ref = ref.reshape(h_a, d)                                         # [h_kv, g, d] -> [h_a, d]
        err = float(np.abs(o - ref).max() / np.abs(ref).max())
        worst = max(worst, err)
        assert err <= 1e-3, (n, err)
    print(f"\ndecode attention {dtype} h_a {h_a} h_kv {h_kv} d {d}: max relative error vs float64 = {worst:.2e}")


def test_kernel_refuses_rows_outside_the_arena(kernels):
    q = aligned(np.zeros((2, 16), np.float32))
    kv = aligned(np.zeros((2, 40, 16), np.float16))
    t = tvm.runtime.from_dlpack
    with pytest.raises(Exception, match="row0"):
        kernels[(2, 2, 16, "float16")](t(q), t(kv), t(kv), 30, 11, 1.0, t(aligned(q.copy())))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 50])
def test_cache_with_kernel_equals_numpy_path(kernels, dtype, window):
    h_a, h_kv, d = 8, 2, 16
    rng = np.random.default_rng(3)
    make = lambda kernel: KVCacheCPU(num_layers=2, num_kv_heads=h_kv, head_dim=d, page_tokens=64, max_tokens=1200,
                                     dtype=dtype, sliding_window=window or None, threads=2, attend_kernel=kernel)
    fast, slow = make(kernels[(h_a, h_kv, d, dtype)]), make(None)
    assert fast.uses_kernel and not slow.uses_kernel and fast.arenas[0].dtype.itemsize == 2
    worst = 0.0
    for S in (700, 1, 1, 1, 1):
        for layer in range(2):
            k, v = rng.standard_normal((2, S, h_kv, d), dtype=np.float32)
            q = rng.standard_normal((S, h_a, d), dtype=np.float32)
            outs = []
            for cache in (fast, slow):
                cache.append(layer, k, v)
                outs.append(cache.attend(layer, q, 0.25))
            assert outs[0].shape == (S, h_a, d) and outs[0].dtype == np.float32
            if S == 1:      # a fresh 64-byte-aligned array: the CPU stage passes it on as a tensor without a copy
                assert outs[0].ctypes.data % 64 == 0 and outs[0].flags.c_contiguous
            worst = max(worst, float(np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()))
        for cache in (fast, slow):
            cache.advance(S)
    print(f"\nKVCacheCPU {dtype} window {window}: max relative |kernel - NumPy| over 4 decode steps = {worst:.2e}")
    assert worst < 1e-4
    slow.close()



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 50])
def test_decode_batch_equals_per_sequence_calls(kernels, dtype, window):
    """DecodeBatch (a batched decode step's attention, Stage.forward_batch) against each cache's own append +
    attend: the same output bits per sequence, zero padding rows, the same arena bytes, over decode steps that
    cross a page boundary; the third cache's second page is not the slot after its first (another sequence
    holds that one), so from then on its kernel cannot take it and it attends on the cache's own path."""
    from helmc.runtime.kv.cache_cpu import DecodeBatch
    h_a, h_kv, d, L = 8, 2, 16, 3
    rng = np.random.default_rng(5)

    def make():
        c = KVCacheCPU(num_layers=L, num_kv_heads=h_kv, head_dim=d, page_tokens=64, max_tokens=640, dtype=dtype,
                       sliding_window=window or None, threads=1, attend_kernel=kernels[(h_a, h_kv, d, dtype)])
        for arena in c.arenas:
            arena[...] = 0                           # rows never written compare equal too
        return c

    prompts = (61, 126, 62)
    pairs = [(make(), make()) for _ in prompts]
    for b, n in enumerate(prompts):
        kv = rng.standard_normal((L, 2, n, h_kv * d), dtype=np.float32)
        for cache in pairs[b]:
            for layer in range(L):
                cache.append(layer, kv[layer, 0], kv[layer, 1])
            cache.advance(n)
            if b == 2:
                cache.pool.reserve(cache.pool.add_sequence(), 1)     # takes slot 1
    batch, mine = DecodeBatch(h_a, d), [m for m, _ in pairs]
    assert DecodeBatch.applies(mine, h_a * d) and not DecodeBatch.applies(mine + [KVCacheCPU(1, h_kv, d)], h_a * d)
    S = 4                                            # three sequences and a padding row
    for step in range(5):
        for layer in range(L):
            q = rng.standard_normal((S, h_a * d), dtype=np.float32)
            k, v = rng.standard_normal((2, S, h_kv * d), dtype=np.float32)
            got = batch.attend(mine, layer, tvm.runtime.tensor(q), tvm.runtime.tensor(k), tvm.runtime.tensor(v),
                               0.25).numpy()
            for b, (_, ref) in enumerate(pairs):
                ref.append(layer, k[b:b + 1], v[b:b + 1])
                want = ref.attend(layer, q[b:b + 1], 0.25).reshape(-1)
                assert np.array_equal(got[b].view(np.uint32), want.view(np.uint32)), (step, layer, b)
            assert not got[len(pairs):].any()
        for m, ref in pairs:
            m.advance(1)
            ref.advance(1)
            assert m.length == ref.length
            assert all(np.array_equal(a.view(np.uint16), r.view(np.uint16)) for a, r in zip(m.arenas, ref.arenas))
    # The second cache's window left its page 0 behind: released, its slot 0 then took page 2, after page 1's slot.
    assert len(mine[2].kind_pages(0).slot_runs(mine[2].length, 0)) == 2 and \
        len(mine[1].kind_pages(0).slot_runs(mine[1].length, 0)) == (2 if window else 1)

def test_bf16_append_rounds_to_nearest_even():
    cache = KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=4, max_tokens=8, dtype="bfloat16")
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0); 1 + 3 * 2^-8 ties up to 1.015625.
    k = np.array([[[1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.0]]], np.float32)          # [1, h_kv, d]
    cache.append(0, k, k)
    stored_k = (cache.arenas[0][0, 0, 0, :1].astype(np.uint32) << 16).view(np.float32)
    assert stored_k.tolist() == [[1.0, 1.0, 1.015625, -2.0]]
    assert KVCacheCPU.bytes_per_token(1, 1, 4, "bfloat16") == 16


def test_kernel_ships_in_the_executable_and_is_found_by_name(tmp_path):
    from tvm import relax
    from tvm.script import relax as R
    from helmc.compiler.passes.schedule_cpu_stage import decode_attention_kernels
    from qwen3_configs import qwen3_spec

    @tvm.script.ir_module
    class Stage:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            return R.add(x, x)

    spec = qwen3_spec("Qwen3-8B")                     # bfloat16 checkpoint: bf16 KV
    mod = Stage
    for name, func in decode_attention_kernels(spec, AVX2, cores=2).items():
        mod[name] = func
    path = str(tmp_path / "stage.so")
    tvm.compile(mod, target=llvm_target(AVX2)).export_library(path)
    vm = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    assert find_decode_kernel(vm.module, 32, 8, 128, "bfloat16") is not None
    assert find_decode_kernel(vm.module, 32, 8, 128, "float16") is None      # not compiled: NumPy fallback
    assert decode_attention_kernels(qwen3_spec("Qwen3-8B", torch_dtype="float32"), AVX2) == {}


def test_fp16_bundle_decodes_on_the_kernel(tiny):
    """A built fp16 bundle ships the kernel, the session's CPU KV is fp16 and attends on it, and its decode
    logits equal the NumPy path's (the kernel taken away from the same session) step by step."""
    from helmc.runtime.session import Session
    s = Session.load(tiny.bundle("qwen3", "float16"))
    kv = s.cpu_stage.kv
    assert kv.uses_kernel and kv.kv_dtype == "float16"
    prompt, steps = [3, 14, 15, 92, 65, 35], [8, 97, 9, 32]
    logits = {}
    for label, kernel in (("kernel", kv._kernel), ("numpy", None)):
        s.reset()
        kv._kernel = kernel
        s.forward(prompt)
        logits[label] = np.concatenate([s.forward([t]) for t in steps])      # [steps, V]
    err = float(np.abs(logits["kernel"] - logits["numpy"]).max() / np.abs(logits["numpy"]).max())
    print(f"\nqwen3 fp16 bundle: max relative |kernel - NumPy| decode logits over {len(steps)} steps = {err:.2e}")
    assert err < 1e-4


def test_one_sequence_decode_fast_path_is_bitwise_append_attend(tiny):
    """Stage.run_blocks' one-token step on a host cache with the kernel goes through DecodeBatch (rows written into
    the arena, the kernel's buffer handed on); its logits equal the append + attend path's bit for bit, token by
    token, and the cache holds the same rows afterwards."""
    from helmc.runtime.session import Session
    from helmc.runtime.stage import Stage
    s = Session.load(tiny.bundle("qwen3", "float16"))
    stage, kv = s.cpu_stage, s.cpu_stage.kv
    assert stage._decode_batch_for([kv]) is not None        # the fast path applies to this session
    prompt, steps = [3, 14, 15, 92, 65, 35], [8, 97, 9, 32, 7]
    logits, arenas = {}, {}
    for label in ("fast", "append_attend"):
        s.reset()
        if label == "append_attend":
            stage._decode_batch_for = lambda caches: None        # this stage's instance only
        s.forward(prompt)
        logits[label] = np.concatenate([s.forward([t]) for t in steps])      # [steps, V]
        n = len(prompt) + len(steps)
        arenas[label] = np.stack([np.concatenate([b.load()[0], b.load()[1]], axis=1)
                                  for layer in range(kv.num_layers) for b in kv._blocks(layer, n, widen=False)])
    assert Stage._decode_batch_for is not stage._decode_batch_for
    assert np.array_equal(logits["fast"], logits["append_attend"])
    assert np.array_equal(arenas["fast"], arenas["append_attend"])
