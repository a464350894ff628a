"""Capacity planning (runtime/kv_capacity.py): how many tokens fit and which memory runs out first."""
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv_capacity import (HOST_RAM, MODEL_WINDOW, VRAM, check_request, kv_bytes_per_token,
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
