"""Allocation failures injected at weight load, KV allocation and pinned allocation (HELMC_FAULT_ALLOC=SITE[:N],
runtime/memory/allocation.py: the Nth allocation at SITE raises MemoryError before allocating).

Each gives one typed error naming what was being allocated and how much; afterwards nothing the failed attempt
allocated is held by anything but the test's own list (so it is freed), and a second load in the same process
works and gives the tokens a load that never failed gives. On this CPU machine: weights and KV through
Session.load of a real bundle, pinned memory through the GPU KV cache's host extents on the emulated device
(tests/kv_device_emulator.py). On a GPU machine the same three on a CPU + GPU bundle (gpu marker).
"""
from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest

from cli_check import cli, refused, tree
from helmc.errors import HelmcError
from tests.gpu_prebuilt import prebuilt_dir

PROMPT = [1, 2, 3, 4, 5]
UPLOAD_CHUNK = 64 << 20      # cuda_runtime.PinnedUploader's default chunk


@pytest.fixture
def allocations(monkeypatch):
    """(site, nbytes, object) of every allocation through runtime/memory/allocation.allocate while the test runs."""
    from helmc.runtime.memory import allocation
    seen = []
    monkeypatch.setattr(allocation, "observers", [lambda site, n, obj: seen.append((site, n, obj))])
    monkeypatch.delenv(allocation.FAULT_ENV, raising=False)
    allocation.reset_fault_counts()
    yield seen
    allocation.reset_fault_counts()


def _held(seen) -> list[tuple[str, int]]:
    """The allocations that something besides `seen` still refers to (refcount: the list's tuple, the loop's
    name and getrefcount's argument are 3)."""
    gc.collect()
    return [(site, n) for site, n, obj in seen if sys.getrefcount(obj) > 3]


def _load_fails_cleanly(load, site, which, allocations, monkeypatch):
    """Load once (the reference tokens, and how many allocations SITE has), then again with the chosen one of
    them failing, then once more: returns (the error's message, tokens of the first and of the last load)."""
    from helmc.runtime.memory.allocation import FAULT_ENV, SITES
    s = load()
    count = sum(a[0] == site for a in allocations)                        # those of the load, not of generating
    want = s.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False).tokens
    held = _held(allocations)
    loose = [(a[0], a[1]) for a in allocations if (a[0], a[1]) not in held]
    # control: a live session holds them all but the GPU loader's two pinned upload-staging chunks
    # (cuda_runtime.PinnedUploader, released once the weights are on the device; measured on the H100)
    assert count >= 1 and all(a == ("pinned", UPLOAD_CHUNK) for a in loose) and len(loose) <= 2, \
        f"not held while the session lives: {loose}"
    del s
    allocations.clear()
    nth = {"first": 1, "middle": count // 2 + 1, "last": count}[which]
    monkeypatch.setenv(FAULT_ENV, f"{site}:{nth}")
    with pytest.raises(HelmcError) as e:
        load()
    message = str(e.value)
    del e
    assert message.startswith("memory: expected ") and SITES[site] in message and "injected" in message, message
    assert sum(a[0] == site for a in allocations) == nth - 1              # the failing one allocated nothing
    held = _held(allocations)
    print(f"{site} allocation {nth} of {count} failed: {len(allocations)} allocations made before it, "
          f"{len(held)} still held; error: {message[:120]}")
    assert held == [], held
    monkeypatch.delenv(FAULT_ENV)
    allocations.clear()
    again = load()
    return message, want, again.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False).tokens


@pytest.mark.parametrize("site,which", [("weights", "first"), ("weights", "middle"), ("weights", "last"),
                                        ("kv", "first")])
def test_allocation_failure_at_load(site, which, tiny, allocations, monkeypatch):
    from helmc.runtime.session import Session
    bundle = tiny.bundle("qwen3")
    _, want, got = _load_fails_cleanly(lambda: Session.load(bundle), site, which, allocations, monkeypatch)
    assert got == want


def test_allocation_failure_through_the_cli(tiny, tmp_path, workdir, monkeypatch):
    from helmc.runtime.memory.allocation import reset_fault_counts
    reset_fault_counts()
    bundle = tiny.bundle("qwen3")
    before = tree(tmp_path, bundle)
    refused(cli("run", bundle, "--prompt-ids", "1,2,3", env={"HELMC_FAULT_ALLOC": "weights:2"}),
            "memory: expected", "free for model weights", "the allocation failed (MemoryError: injected")
    assert tree(tmp_path, bundle) == before
    reset_fault_counts()


# ---- pinned memory, on the emulated device --------------------------------------------------------
def _gpu_kv():
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    from kv_device_emulator import EmulatedOps
    return KVCacheGPU(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=8, max_tokens=256, gpu_pages=3,
                      watermark=0.5, staging_pages=4, host_extent_pages=2, ops=EmulatedOps(num_sms=2))


def _feed(kv) -> list[np.ndarray]:
    """A prompt of 37 tokens then 12 decode steps: the prompt's older pages go out to pinned host extents."""
    rng = np.random.default_rng(0)
    outs = []
    for n in [37] + [1] * 12:
        for layer in range(kv.L):
            k, v = rng.standard_normal((2, n, 2, 32)).astype(np.float32)
            q = rng.standard_normal((n, 8, 32)).astype(np.float32)
            kv.append(layer, k, v)
            outs.append(kv.attend(layer, q, 0.2))
        kv.advance(n)
    return outs


def test_pinned_allocation_failure_emulated(allocations, monkeypatch):
    from helmc.runtime.memory.allocation import FAULT_ENV
    want = _feed(_gpu_kv())
    pinned = sum(a[0] == "pinned" for a in allocations)
    assert pinned >= 2, "the feed offloads pages to more than one pinned extent"
    allocations.clear()
    monkeypatch.setenv(FAULT_ENV, "pinned:2")
    kv = _gpu_kv()
    with pytest.raises(HelmcError, match=r"memory: expected .* free for pinned \(page-locked\) host memory \(KV pages"):
        _feed(kv)
    refs = [weakref.ref(obj) for _, _, obj in allocations]
    assert [a[0] for a in allocations] == ["kv", "pinned"]                # the page pool, the first extent
    allocations.clear()
    del kv
    gc.collect()
    assert all(r() is None for r in refs), "a buffer of the failed cache is still held"
    print(f"pinned allocation 2 of {pinned} failed (emulated device): {len(refs)} buffers allocated before it, all freed")
    monkeypatch.delenv(FAULT_ENV)
    got = _feed(_gpu_kv())
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


# ---- the same on a GPU (run by hand on the GPU machine, as tests/runtime/test_session_gpu.py) --------
def _gpu_bundle() -> str:
    return prebuilt_dir("HELMC_GPU_SESSION_BUNDLE", "kv_session/bundle", "manifest.json", "GPU test bundle",
                        "build_kv_session_bundle .devrt/kv_session")


@pytest.mark.gpu
@pytest.mark.parametrize("site,which", [("weights", "middle"), ("kv", "first"), ("pinned", "first"),
                                        ("pinned", "last")])
def test_allocation_failure_at_gpu_load(site, which, allocations, monkeypatch):
    bundle = _gpu_bundle()
    import cupy as cp

    from helmc.runtime.session import Session
    pool = cp.get_default_memory_pool()
    used = pool.used_bytes()
    load = lambda: Session.load(bundle, kv_page_tokens=16, kv_watermark=1e-9)      # KV pages forced to pinned RAM
    _, want, got = _load_fails_cleanly(load, site, which, allocations, monkeypatch)
    assert got == want
    gc.collect()
    assert pool.used_bytes() <= used + (64 << 20)
