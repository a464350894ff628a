"""Capacity planning before generating: what a session's KV caches can hold, on the CPU.

- capacity_of_caches over a real KVCacheCPU and a KVCacheGPU on tests/kv_device_emulator.py: exact
  token counts, which memory runs out, and the pinned host memory it predicts equals what the GPU
  cache then allocates while pages are evicted.
- Session.generate on a tiny all-CPU bundle with host RAM (MemAvailable) patched to exact sizes:
  a request one token too long is refused before any work with the numbers; the longest one that
  fits runs; the pages a finished request touched count as the session's own the next time.
Numbers are derived here from the shapes; nothing to regenerate.
"""
from __future__ import annotations

import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv import capacity as kc
from helmc.runtime.kv.cache_cpu import KVCacheCPU
from helmc.runtime.kv.cache_gpu import KVCacheGPU
from kv_device_emulator import EmulatedOps

T, H_KV, D = 8, 2, 32


def caches(max_tokens=256):
    cpu = KVCacheCPU(num_layers=3, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=max_tokens)
    gpu = KVCacheGPU(num_layers=2, num_kv_heads=H_KV, head_dim=D, page_tokens=T, max_tokens=max_tokens, gpu_pages=6,
                     watermark=0.5, staging_pages=4, host_extent_pages=4, ops=EmulatedOps(num_sms=2))
    return cpu, gpu


def feed(kv, steps, seed=0):
    """Append/attend/advance like a stage: one prompt step then single tokens, random K/V/Q."""
    rng = np.random.default_rng(seed)
    for S in steps:
        for layer in range(kv.L if hasattr(kv, "L") else kv.num_layers):
            k, v = rng.standard_normal((2, S, H_KV, D)).astype(np.float32)
            kv.append(layer, k, v)
            kv.attend(layer, rng.standard_normal((S, 2 * H_KV, D)).astype(np.float32), 0.2)
        kv.advance(S)


def test_capacity_of_caches_exact_numbers():
    cpu, gpu = caches()
    # per token: CPU 2 (K,V) * 3 layers * 2 heads * 32 * 4 B; GPU 2 * 2 layers * 2 heads * 32 * 2 B
    cpu_page, gpu_page = 1536 * T, 512 * T
    assert gpu.resident_limit == 3 and gpu.page_bytes == gpu_page
    # n pages need n CPU pages + (n - 3) GPU pages rounded up to extents of 4, in host RAM:
    # 13 pages: 13 * 12288 + 12 * 4096 = 208896 B; 14 pages: 14 * 12288 + 12 * 4096 = 221184 B
    cap = kc.capacity_of_caches(cpu, gpu, host_free_bytes=221183, model_max_tokens=512)
    print(f"13 pages fit in 221183 B: tokens_fit {cap.tokens_fit}, limited by {cap.limited_by}")
    assert (cap.tokens_fit, cap.limited_by) == (13 * T, kc.HOST_RAM)
    assert cap.host_bytes_needed(13 * T) == 208896 and cap.host_bytes_needed(14 * T) == 221184
    assert cap.vram_bytes_needed(13 * T) == 3 * gpu_page
    msg = kc.refusal_message(cap, 100, 5)
    assert msg.startswith("context: prompt 100 + 5 new tokens = 105 tokens do not fit; at most 104 fit: host RAM runs out")
    assert msg.endswith("host RAM runs out (KV of 105 tokens needs 216.00 KiB of host RAM: CPU-layer KV 168.00 KiB "
                        "+ GPU-layer pages in pinned RAM 48.00 KiB; 216.00 KiB free, short by 1 B)")
    assert kc.capacity_of_caches(cpu, gpu, 221184, 512).tokens_fit == 14 * T
    roomy = kc.capacity_of_caches(cpu, gpu, 1 << 40, 512)
    assert (roomy.tokens_fit, roomy.limited_by) == (256, kc.PLAN_LIMIT)       # what the caches were sized for
    assert "the KV caches were sized for it" in kc.refusal_message(roomy, 250, 7)
    window = kc.capacity_of_caches(cpu, gpu, 1 << 40, 200)
    assert (window.tokens_fit, window.limited_by) == (200, kc.MODEL_WINDOW)
    cpu_only = kc.capacity_of_caches(cpu, None, 10 * cpu_page, 512)
    assert (cpu_only.tokens_fit, cpu_only.limited_by) == (10 * T, kc.HOST_RAM)


def test_predicted_pinned_memory_is_what_the_gpu_cache_allocates():
    for tokens, extents in ((3 * T, 0), (4 * T + 1, 1), (7 * T, 1), (8 * T - 3, 2), (100, 3)):
        cpu, gpu = caches()
        cap = kc.capacity_of_caches(cpu, gpu, 1 << 40, 512)
        prompt = min(tokens, 45)
        feed(gpu, [prompt] + [1] * (tokens - prompt))
        held = kc.caches_host_bytes_held(None, gpu, 0)
        pages = -(-tokens // T)
        on_host = gpu.pool.host_capacity - gpu.pool.host_free
        print(f"{tokens} tokens: {on_host} of {pages} pages on the host, {len(gpu._extents)} extents pinned")
        assert on_host == max(0, pages - gpu.resident_limit)
        assert len(gpu._extents) == extents
        assert cap.pinned_kv_bytes(tokens) == held == extents * 4 * gpu.page_bytes


@pytest.fixture(scope="module")
def cpu_session(tiny):
    from helmc.runtime.session import Session
    s = Session.load(tiny.bundle("qwen3"), kv_page_tokens=16)
    assert s.gpu is None and s.cpu_stage is not None and list(s.plan.placement.cpu_layers) == [0, 1]
    return s


def patch_host_ram(monkeypatch, s, prompt_tokens, kv_bytes):
    """MemAvailable = what a step of this prompt holds besides KV + kv_bytes."""
    spec = s.spec
    step = kc.host_step_bytes(spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim, prompt_tokens, True)
    monkeypatch.setattr(kc, "host_ram_available_bytes", lambda: step + kv_bytes)


def test_generate_refuses_before_any_work_and_runs_what_fits(cpu_session, monkeypatch):
    s = cpu_session
    page = 16 * 2 * 2 * 2 * 32 * 4          # 16 tokens x (K,V) x 2 layers x 2 KV heads x 32 x fp32 = 16384 B
    patch_host_ram(monkeypatch, s, 100, 10 * page)
    calls = []
    real_forward = s.forward
    monkeypatch.setattr(s, "forward", lambda ids, **kw: calls.append(len(ids)) or real_forward(ids, **kw))
    with pytest.raises(HelmcError) as e:
        s.generate(prompt_ids=[5] * 100, max_new_tokens=61)
    print(e.value)
    assert str(e.value) == ("context: prompt 100 + 61 new tokens = 161 tokens do not fit; at most 160 fit: host RAM "
                            "runs out (KV of 161 tokens needs 176.00 KiB of host RAM: CPU-layer KV 176.00 KiB; "
                            "160.00 KiB free, short by 16.00 KiB)")
    assert calls == [], "refused after work had started"
    r = s.generate(prompt_ids=[5] * 100, max_new_tokens=60, stop_at_eos=False)
    assert len(r.tokens) == 60 and calls[0] == 100 and s.kv_capacity.tokens_fit == 160
    # the 10 pages this request touched stay with the session: a second request of the same size fits
    # even though MemAvailable no longer counts them
    patch_host_ram(monkeypatch, s, 100, 0)
    assert s.generate(prompt_ids=[5] * 100, max_new_tokens=60, stop_at_eos=False).tokens == r.tokens
    assert s.kv_capacity.tokens_fit == 160 and s.kv_capacity.limited_by == kc.HOST_RAM


def test_generate_refuses_beyond_the_plan(cpu_session, monkeypatch):
    s = cpu_session
    monkeypatch.setattr(kc, "host_ram_available_bytes", lambda: 1 << 40)
    with pytest.raises(HelmcError, match=f"at most {s.plan.memory.max_context} fit: the plan allows at most "
                                         f"{s.plan.memory.max_context} tokens"):
        s.generate(prompt_ids=[5] * s.plan.memory.max_context, max_new_tokens=1)


def test_host_ram_available_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n")
    assert kc.host_ram_available_bytes(str(f)) == 12345678 * 1024
    f.write_text("MemTotal:       24576000 kB\n")
    assert kc.host_ram_available_bytes(str(f)) is None
    assert kc.host_ram_available_bytes(str(tmp_path / "missing")) is None


def test_forward_argmax_is_the_logits_argmax_and_embedding_rows_stay_float32(cpu_session):
    """forward(argmax=True), what generate() asks for a plain-greedy request, is the last row's argmax of the
    logits forward() returns; a session with CPU blocks keeps float32 embedding rows (native only when every
    block runs on the GPU), and a native Embedding hands fp16 rows over as stored."""
    import numpy as np

    from helmc.runtime.weights.bind import Embedding
    s = cpu_session
    prompt = [5, 9, 13, 2, 7]
    s.reset()
    logits = s.forward(prompt)
    s.reset()
    tok = s.forward(prompt, argmax=True)
    assert isinstance(tok, int) and tok == int(np.argmax(logits[-1]))
    s.reset()
    assert not s._embed.native and s.embed(np.array(prompt)).dtype == np.float32
    native = Embedding(s.checkpoint, s.spec, native=True)
    rows = native(np.array(prompt))
    assert rows.dtype == (np.float16 if s._embed.table.dtype == np.float16 else np.float32)
    np.testing.assert_array_equal(rows.astype(np.float32), s.embed(np.array(prompt)))
