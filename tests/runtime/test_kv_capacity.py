"""Capacity planning (runtime/kv/capacity.py): how many tokens fit and which memory runs out first."""
import numpy as np
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv.capacity import (HOST_RAM, MODEL_WINDOW, VRAM, check_request, kv_bytes_per_token,
                                       plan_kv_capacity, refusal_message)

GIB = 1024 ** 3
# Qwen3-8B split 21 CPU blocks (fp32 KV) / 15 GPU blocks (fp16 KV): 8 KV heads of 128
CPU_BPT = kv_bytes_per_token(21, 8, 128, 4)
GPU_BPT = kv_bytes_per_token(15, 8, 128, 2)


def test_per_token_bytes():
    assert CPU_BPT == 172032 and GPU_BPT == 61440


def test_host_ram_is_the_bound_and_exact():
    cap = plan_kv_capacity(CPU_BPT, GPU_BPT, host_free_bytes=3 * GIB, vram_free_bytes=GIB // 2)
    assert cap.limited_by == HOST_RAM
    assert cap.gpu_resident_pages == int(0.8 * (GIB // 2 // (GPU_BPT * 512)))
    # the answer is the largest whole number of pages whose KV fits: one more page would not
    assert cap.host_bytes_needed(cap.tokens_fit) <= 3 * GIB < cap.host_bytes_needed(cap.tokens_fit + 512)
    assert cap.vram_bytes_needed(cap.tokens_fit) <= GIB // 2
    assert cap.tokens_fit % 512 == 0 and cap.tokens_fit > cap.gpu_resident_tokens


def test_model_window_and_no_offload():
    roomy = plan_kv_capacity(CPU_BPT, GPU_BPT, 100 * GIB, GIB // 2, model_max_tokens=40960)
    assert (roomy.tokens_fit, roomy.limited_by) == (40960, MODEL_WINDOW)
    pinned = plan_kv_capacity(CPU_BPT, GPU_BPT, 100 * GIB, GIB // 2, offload=False, model_max_tokens=40960)
    assert pinned.limited_by == VRAM
    assert pinned.tokens_fit == (GIB // 2) // (GPU_BPT * 512) * 512
    msg = refusal_message(pinned, 12000, 256)
    assert msg.startswith(f"context: prompt 12000 + 256 new tokens = 12256 tokens do not fit; at most "
                          f"{pinned.tokens_fit} fit: VRAM runs out")
    assert "--no-kv-offload" in msg
    with pytest.raises(HelmcError, match="do not fit"):
        check_request(pinned, 12000, 256)
    check_request(pinned, 100, 28)                            # fits: no error


def test_edge_cases():
    one_slot = plan_kv_capacity(0, GPU_BPT, GIB, GPU_BPT * 512 + 1)
    assert (one_slot.tokens_fit, one_slot.limited_by) == (512, VRAM)    # no room to evict into
    none = plan_kv_capacity(CPU_BPT, GPU_BPT, GIB, 100)
    assert none.tokens_fit == 0 and none.limited_by == VRAM
    cpu_only = plan_kv_capacity(CPU_BPT, 0, 10 * CPU_BPT * 512 + 5, 0)
    assert (cpu_only.tokens_fit, cpu_only.limited_by) == (10 * 512, HOST_RAM)
    msg = refusal_message(cpu_only, 6000, 1)
    assert "host RAM runs out" in msg and "6001 tokens" in msg
    with pytest.raises(HelmcError, match="kv-watermark"):
        plan_kv_capacity(CPU_BPT, GPU_BPT, GIB, GIB, watermark=1.5)


def test_runtime_pool_bytes_cover_the_loan():
    """runtime/gpu_session.kv_pool_bytes: the plan's pool in whole pages, never below the loan or two
    pages, never above free VRAM."""
    from helmc.runtime.gpu_session import kv_pool_bytes
    page = 1000
    assert kv_pool_bytes(5_500, 0, 10_000, page) == 5_000                     # whole pages of the plan's pool
    assert kv_pool_bytes(5_500, 5_200, 10_000, page) == 5_200                 # old: 5,000, short of the loan
    assert kv_pool_bytes(100, 0, 10_000, page) == 2_000                       # one resident, one being written
    assert kv_pool_bytes(5_500, 5_200, 3_999, page) == 3_999                  # no more than is free


def test_store_holds_the_loan_beyond_its_whole_slots():
    """KVCacheGPU with loan_bytes: a cache sized for 16 tokens (2 pages of 4,096 B) in 10 pages of VRAM
    had a 2-page store and refused a 20,481 B loan; now its store has the loan's bytes while the
    pages still use 2 slots. Likewise 5,200 B of VRAM (1 whole page + 1,104 B, offload off) holds a
    5,200 B loan. A loan past its VRAM gets only the VRAM (the prefill then allocates, as before)."""
    from kv_device_emulator import EmulatedOps

    from helmc.runtime.kv.cache_gpu import KVCacheGPU

    def make(max_tokens=16, vram_bytes=10 * 4096, **kw):
        return KVCacheGPU(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=8, max_tokens=max_tokens,
                          vram_bytes=vram_bytes, staging_pages=4, ops=EmulatedOps(num_sms=2), **kw)
    old = make()
    assert (old.page_bytes, old.gpu_store.nbytes) == (4096, 2 * 4096)
    assert old.lend_empty_pool(5 * 4096 + 1) is None
    for offload in (True, False):
        kv = make(loan_bytes=5 * 4096 + 1, offload=offload)
        assert kv.gpu_pages == 2 and kv.gpu_store.shape[0] == 2
        loan = kv.lend_empty_pool(5 * 4096 + 1)
        assert loan is not None and loan.size == 5 * 4096 + 1 and np.shares_memory(loan, kv.gpu_store)
    tail = make(max_tokens=8, vram_bytes=5_200, loan_bytes=5_200, offload=False)
    assert tail.gpu_store.nbytes == 4096 and tail.lend_empty_pool(5_200) is not None
    assert make(max_tokens=8, vram_bytes=5_200, offload=False).lend_empty_pool(5_200) is None
    assert make(loan_bytes=11 * 4096).lend_empty_pool(10 * 4096 + 1) is None     # capped at its VRAM
