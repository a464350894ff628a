"""The planner's KV of sliding-window blocks (helmc/planner/cost_model.py sliding_kv_tokens): the CPU cache keeps a
sliding block's window and one page more (plus a one-step prompt's rows), so its KV stops growing there and
max_context grows; the GPU cache keeps every page. Exact byte counts on Gemma-3-12B's shapes (48 blocks, every
sixth global, window 1024, 8 KV heads of 256, bf16: 8192 bytes of K + V a token and block)."""
import dataclasses

import pytest

from helmc.hardware.profile import load_hardware
from helmc.model.spec import ModelSpec, RopeSpec
from helmc.planner.analyze_program import analyze_program
from helmc.planner.cost_model import DeviceRates, Workload, max_context, memory_needs, sliding_kv_tokens, stage_time

KV_TOKEN = 2 * 8 * 256 * 2
PAGE = 512


def gemma12b(window: int = 1024) -> ModelSpec:
    return ModelSpec(architecture="Gemma3ForCausalLM", hidden_size=3840, intermediate_size=15360, num_layers=48,
                     num_heads=16, num_kv_heads=8, head_dim=256, vocab_size=262208, rms_norm_eps=1e-6,
                     rope=RopeSpec(theta=1e6), max_position_embeddings=131072, tie_word_embeddings=True,
                     dtype="bfloat16", qkv_bias=False, qk_norm=True, sliding_window=window,
                     global_layers=tuple(range(5, 48, 6)) if window else (), norm_offset=1.0, sandwich_norms=True,
                     hidden_act="gelu_pytorch_tanh")


@pytest.fixture(scope="module")
def g12():
    return analyze_program(gemma12b())


@pytest.fixture(scope="module")
def laptop():
    return load_hardware("rtx4060-laptop")


def test_units_carry_the_sliding_share(g12):
    blocks = g12.stage(1, 49)
    assert blocks.kv_bytes_per_token == 48 * KV_TOKEN and blocks.sliding_kv_bytes_per_token == 40 * KV_TOKEN
    assert g12.stage(6, 7).sliding_kv_bytes_per_token == 0            # block 5: global
    assert g12.stage(1, 6).sliding_kv_bytes_per_token == 5 * KV_TOKEN
    assert analyze_program(gemma12b(window=0)).stage(1, 49).sliding_kv_bytes_per_token == 0


def test_host_kv_counts_window_plus_a_page(g12, laptop):
    w = Workload(prompt_len=128, output_len=8064, stream_prefill=False)      # 8192 tokens
    assert sliding_kv_tokens(g12, w, 8192) == 1536 + PAGE                   # whole_pages(1024 + 127) + a page
    host, _ = memory_needs(g12, laptop, g12.stage(0, 50), g12.stage(50, 50), w)
    assert host.kv == 8 * KV_TOKEN * 8192 + 40 * KV_TOKEN * 2048 == 1_207_959_552    # was 3,221,225,472
    host, _ = memory_needs(g12, laptop, g12.stage(0, 50), g12.stage(50, 50), w, context=1000)
    assert host.kv == 48 * KV_TOKEN * 1024                                  # below the cap: every token
    # A split, offloaded: the CPU's blocks 0..23 (4 global, 20 sliding) windowed; the GPU's 24 keep every page.
    host, dev = memory_needs(g12, laptop, g12.stage(0, 25), g12.stage(25, 50), w)
    assert host.kv == (4 + 24) * KV_TOKEN * 8192 + 20 * KV_TOKEN * 2048 == 2_214_592_512
    _, dev = memory_needs(g12, laptop, g12.stage(0, 25), g12.stage(25, 50), dataclasses.replace(w, kv_offload=False))
    assert dev.kv == 24 * KV_TOKEN * 8192
    # A longer prompt prefilled in one step holds its rows beside the window.
    long = Workload(prompt_len=4000, output_len=4192, stream_prefill=False)
    assert sliding_kv_tokens(g12, long, 8192) == 5120 + PAGE


def test_max_context_grows_with_sliding_blocks(g12, laptop):
    w = Workload(prompt_len=128, output_len=128, stream_prefill=False)
    cpu, none = g12.stage(0, 50), g12.stage(50, 50)
    host0, _ = memory_needs(g12, laptop, cpu, none, w, context=0)
    cap_bytes = (8 + 40) * KV_TOKEN * 2048                                  # every block up to the cap
    room = cap_bytes + 8 * KV_TOKEN * 20000                                 # then the 8 global blocks' 20000 tokens
    hw = dataclasses.replace(laptop, cpu=dataclasses.replace(laptop.cpu, ram_free_bytes=host0.total + room,
                                                             ram_total_bytes=2 * (host0.total + room)))
    assert max_context(g12, hw, cpu, none, w) == 22016                     # 2048 + 20000 -> whole pages: 43 * 512
    g0 = analyze_program(gemma12b(window=0))                                # every block global: 5381 tokens
    assert max_context(g0, hw, g0.stage(0, 50), none, w) == room // (48 * KV_TOKEN) // PAGE * PAGE == 5120
    host, _ = memory_needs(g12, hw, cpu, none, w, context=22016)
    assert host.fits and not memory_needs(g12, hw, cpu, none, w, context=22016 + PAGE)[0].fits
    free = host0.total + 48 * KV_TOKEN * 1500
    small = dataclasses.replace(laptop, cpu=dataclasses.replace(laptop.cpu, ram_free_bytes=free,
                                                                ram_total_bytes=2 * free))
    assert max_context(g12, small, cpu, none, w) == 1024                    # below the cap: every block a token


def test_decode_attention_reads_each_block_over_its_own_span(g12):
    """The 40 sliding blocks read their 1024-token window, the 8 global ones the whole context (8192 on average
    over the output): 872,415,232 bytes a token at 100 GB/s, 8.724 ms. Every block read over the window alone
    (what a model whose blocks all slide gets) would be 402,653,184."""
    rates = DeviceRates(mem_gbs=100.0, compute_gflops=0.0)
    w = Workload(prompt_len=8000, output_len=384)
    t = stage_time(g12, g12.stage(1, 49), rates, w, blend_l3=False)
    assert t.attn_ms == pytest.approx((8 * KV_TOKEN * 8192 + 40 * KV_TOKEN * 1024) / 100e9 * 1e3, rel=1e-12)
    mistral = analyze_program(dataclasses.replace(gemma12b(), global_layers=()))
    t = stage_time(mistral, mistral.stage(1, 49), rates, w, blend_l3=False)
    assert t.attn_ms == pytest.approx(48 * KV_TOKEN * 1024 / 100e9 * 1e3, rel=1e-12)
