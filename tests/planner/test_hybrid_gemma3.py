"""Gemma 3 under a VRAM budget: the planner may stream its prefill and decode it hybrid, as for dense Qwen3, now that
the streamed and staged blocks take their own windows and RoPE tables; the streamed prefill's prompt buffers hold
both RoPE tables, counted alike by the runtime and the cost model; which table and window each block takes."""
import dataclasses

import numpy as np

from helmc.compiler.pipeline import check_placement
from helmc.hardware.profile import KernelRead, load_hardware
from helmc.model.spec import ModelSpec, RopeSpec
from helmc.planner.analyze_program import analyze_program
from helmc.planner.cost_model import prefill_prompt_bytes
from helmc.planner.search_partition import plan
from helmc.runtime.bundle.plan_check import check_plan


def gemma3_12b(**over) -> ModelSpec:
    """Gemma-3-12B's shapes (48 blocks, every sixth global, window 1024, its local RoPE base 10000) in Q4_K_M's type
    mix (q6_k v and down in every other block, the head q6_k): llama.cpp's file of the issue's case."""
    mix_a = ("q4_k",) * 2 + ("q6_k",) + ("q4_k",) * 3 + ("q6_k",)
    spec = ModelSpec(architecture="Gemma3ForCausalLM", hidden_size=3840, intermediate_size=15360, num_layers=48,
                     num_heads=16, num_kv_heads=8, head_dim=256, vocab_size=262208, rms_norm_eps=1e-6,
                     rope=RopeSpec(theta=1e6, kind="linear", factor=8.0), max_position_embeddings=131072,
                     tie_word_embeddings=True, dtype="bfloat16", qkv_bias=False, qk_norm=True, sliding_window=1024,
                     global_layers=tuple(range(5, 48, 6)), norm_offset=1.0, sandwich_norms=True,
                     hidden_act="gelu_pytorch_tanh", local_rope=RopeSpec(theta=10000.0),
                     layer_types=tuple(mix_a if i % 2 == 0 else ("q4_k",) * 7 for i in range(48)),
                     head_type="q6_k", embed_type="q4_k")
    return dataclasses.replace(spec, **over)


def gpu_machine():
    """The GPU test machine's measured profile with helmc's CPU GEMVs at the rates measured on its Xeon (q4_k 37,
    q6_k 49 GB/s: they decode, not stream, at that rate) and no per-block overheads."""
    hw = load_hardware("h100-sxm-measured")
    cpu = dataclasses.replace(hw.cpu, host_read_gbs=92.0, block_overhead_ms=0.0, step_overhead_ms=0.0, gemv_reads=(
        KernelRead("float16", 92.0), KernelRead("bfloat16", 92.0), KernelRead("q4_k", 37.0), KernelRead("q6_k", 49.0)))
    gpu = dataclasses.replace(hw.gpu, block_overhead_ms=0.0, step_overhead_ms=0.0)
    link = dataclasses.replace(hw.link, h2d_gbs=54.0, d2h_gbs=54.0, h2d_concurrent_gbs=54.0, cpu_read_concurrent_gbs=92.0)
    return dataclasses.replace(hw, cpu=cpu, gpu=gpu, link=link, block_overhead_ms=0.0)


def test_gemma3_12b_q4_k_m_under_6_gib_decodes_hybrid():
    """The issue's case: under 6 GiB the search picks hybrid groups with the prefill streamed, predicted well ahead
    of the best plain split; its streamed groups hold global blocks beside sliding ones; the build and the load
    accept the plan."""
    spec, hw = gemma3_12b(), gpu_machine()
    p = plan(spec, hw, gpu_budget_gib=6)
    split = plan(spec, hw, gpu_budget_gib=6, hybrid=False)
    print(f"\nGemma-3-12B Q4_K_M under 6 GiB: {p.describe()} {p.predictions.t_plan_ms:.2f} ms, plain "
          f"{split.describe()} {split.predictions.t_plan_ms:.2f} ms")
    pl = p.placement
    assert pl.groups and pl.prefill_on_gpu and not split.placement.groups
    assert split.predictions.t_plan_ms / p.predictions.t_plan_ms > 1.5
    assert {spec.layer_window(i) for i in pl.streamed_layers} == {0, 1024}      # global and sliding blocks streamed
    assert p.memory.staging_ring_bytes >= max(g.weight_bytes for g in pl.groups if g.kind == "streamed")
    check_placement(spec, p, hw)
    check_plan(p, spec, p)
    # a roomy budget keeps it all on the GPU; without hybrid decode, no groups
    assert not plan(spec, hw, gpu_budget_gib=40).placement.groups
    assert not plan(spec, hw, gpu_budget_gib=6, hybrid=False).placement.groups


def test_tiny_gemma3_goes_hybrid_where_it_wins():
    """A tiny Gemma 3 (4 blocks, block 2 global) under a budget a block and a half short of all on the GPU: the search
    streams the host blocks' prefill and decodes C0 [0, 1] S0 [2] | resident [3], predicted faster than the plain
    split of the same budget; the build and the load accept it."""
    from helmc.planner.budget import budgeted
    spec = ModelSpec(architecture="Gemma3ForCausalLM", hidden_size=1024, intermediate_size=4096, num_layers=4,
                     num_heads=8, num_kv_heads=4, head_dim=256, vocab_size=1024, rms_norm_eps=1e-6,
                     rope=RopeSpec(theta=1e6), max_position_embeddings=4096, tie_word_embeddings=True,
                     dtype="bfloat16", qkv_bias=False, qk_norm=True, sliding_window=8, global_layers=(2,),
                     norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh",
                     local_rope=RopeSpec(theta=10000.0))
    hw = gpu_machine()
    block = max(u.stored_bytes for u in analyze_program(spec).units if u.kind == "block")
    budget = (plan(spec, hw, prompt_len=16, output_len=16).memory.gpu_bytes - 1.5 * block) / 2**30
    p = plan(spec, hw, prompt_len=16, output_len=16, gpu_budget_gib=budget)
    split = plan(spec, hw, prompt_len=16, output_len=16, gpu_budget_gib=budget, hybrid=False)
    assert [(g.kind, g.first_layer, g.num_layers) for g in p.placement.groups] == [("cpu", 0, 2), ("streamed", 2, 1)]
    assert p.placement.prefill_on_gpu and split.describe() == "cpu(4) -> cuda(2)" and not split.placement.groups
    assert p.predictions.t_plan_ms < split.predictions.t_plan_ms
    check_placement(spec, p, budgeted(hw, budget))
    check_plan(p, spec, p)


def test_prompt_buffers_hold_both_rope_tables():
    """The streamed prefill's cos and sin rows are [S, 2 head_dim] with a local RoPE (RopeTables' rows): the runtime
    asks for that much and the cost model counts the same."""
    from helmc.runtime.prefill_stream import prompt_buffer_sizes, streamed_prefill_bytes
    spec = gemma3_12b()
    assert spec.rope_width == 512 and gemma3_12b(local_rope=None).rope_width == 256
    sizes = prompt_buffer_sizes(100, 3840, 8, 256, spec.rope_width)
    assert sizes[2:] == (100 * 512 * 4, 100 * 512 * 4)
    for s in (spec, gemma3_12b(local_rope=None)):
        for S, batch in ((100, 1), (4096, 1), (77, 3)):
            assert prefill_prompt_bytes(analyze_program(s), S, batch) == streamed_prefill_bytes(0, [S] * batch, s)


def test_each_block_takes_its_rope_table():
    """block_rope hands a sliding block the local table's half of RopeTables' rows and a global block the global
    one's: each equals the table made alone with that block's RoPE."""
    from helmc.runtime.rope import RopeTables, block_rope, rope_tables
    spec = gemma3_12b()
    pos = np.arange(0, 3000, 7)
    cos, sin = rope_tables(spec).cos_sin(pos)                       # [S, 2D]
    assert cos.shape == (len(pos), spec.rope_width)
    for layer, rope in ((5, spec.rope), (4, spec.local_rope), (47, spec.rope), (0, spec.local_rope)):
        c, s = block_rope(spec, layer, cos, sin)
        alone = RopeTables(rope, spec.head_dim).cos_sin(pos)
        np.testing.assert_array_equal(c, alone[0])
        np.testing.assert_array_equal(s, alone[1])
    plain = gemma3_12b(local_rope=None)                              # one table: every block takes all of it
    c1, s1 = rope_tables(plain).cos_sin(pos)
    for layer in (4, 5):
        c, s = block_rope(plain, layer, c1, s1)
        assert c.shape == c1.shape and np.array_equal(c, c1) and np.array_equal(s, s1)


def test_gpu_cache_windows_follow_the_streamed_blocks():
    """A hybrid plan's GPU cache holds the streamed blocks first (1..5 and 8..11 here: blocks 5 and 11 global), then
    the resident ones: each layer carries its own block's window."""
    from helmc.planner.hybrid import forced_layout
    from helmc.runtime.bundle.plan import Plan
    from helmc.runtime.gpu_session import gpu_cache_layers, gpu_cache_windows
    spec = gemma3_12b()
    p = forced_layout(Plan.of(num_layers=48, cpu_units=0, max_context=4096), spec, ((1, 5), (2, 4)))
    assert gpu_cache_layers(p.placement) == (1, 2, 3, 4, 5, 8, 9, 10, 11) + tuple(range(12, 48))
    windows = gpu_cache_windows(spec, p.placement)
    assert windows[:9] == (1024, 1024, 1024, 1024, 0, 1024, 1024, 1024, 0)
    assert windows[9:] == tuple(0 if i % 6 == 5 else 1024 for i in range(12, 48))
