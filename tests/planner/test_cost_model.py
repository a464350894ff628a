"""The cost model (thesis eqs. 4.7-4.16 and the delta of 6.4.4), term by term, against hand
arithmetic on the thesis's running example (Qwen3-8B, rtx4060-laptop preset) and on synthetic
rates chosen so that one term binds at a time."""
import dataclasses

import pytest

from helmc.planner.analyze_program import analyze_program
from helmc.planner.cost_model import (KV_PAGE_TOKENS, KV_SCORE_TILE_BYTES, DeviceRates, Workload, comm_time_ms, gpu_kv_resident_bytes, max_context,
                              memory_needs, roofline_ms, stage_time)
from helmc.errors import HelmcError
from helmc.hardware.profile import load_hardware
from qwen3_configs import qwen3_spec

BLOCK_BYTES = 385_892_864              # Qwen3-8B block, bf16 (test_analyze_program derives it)
KV_TOKEN = 4096                        # K + V bytes per token per block


@pytest.fixture(scope="module")
def q8():
    return analyze_program(qwen3_spec("Qwen3-8B"))


@pytest.fixture(scope="module")
def laptop():
    return load_hardware("rtx4060-laptop")


def test_projection_term_running_example(q8, laptop):
    """Thesis 4.1.3: 386 MB / 45 GB/s = 8.6 ms on the CPU and 386 / 218 = 1.8 ms on the GPU per block;
    36 blocks on the CPU ~ 310 ms."""
    w = Workload()
    cpu = DeviceRates.of_cpu(laptop.cpu, block_overhead_ms=0.0)
    gpu = DeviceRates.of_gpu(laptop.gpu, block_overhead_ms=0.0)
    one_cpu = stage_time(q8, q8.stage(1, 2), cpu, w, blend_l3=True)
    one_gpu = stage_time(q8, q8.stage(1, 2), gpu, w, blend_l3=False)
    all_cpu = stage_time(q8, q8.stage(1, 37), cpu, w, blend_l3=True)
    print(f"per block: CPU {one_cpu.proj_ms:.3f} ms (thesis 8.6), GPU {one_gpu.proj_ms:.3f} ms (thesis 1.8); "
          f"36 blocks on the CPU {all_cpu.proj_ms:.1f} ms (thesis ~310)")
    assert one_cpu.proj_ms == pytest.approx(BLOCK_BYTES / 45e9 * 1e3, rel=1e-9)
    assert round(one_cpu.proj_ms, 1) == 8.6 and round(one_gpu.proj_ms, 1) == 1.8
    assert all_cpu.proj_ms == pytest.approx(310, rel=0.01)


def test_roofline_takes_the_binding_term():
    rates = DeviceRates(mem_gbs=100.0, compute_gflops=50.0)
    assert roofline_ms(1e9, 1e6, rates) == pytest.approx(20.0)                 # compute-bound: 1 GFLOP / 50
    assert roofline_ms(1e6, 1e9, rates) == pytest.approx(10.0)                 # memory-bound: 1 GB / 100
    slow = dataclasses.replace(rates, eta_memory=0.5, eta_compute=0.25)
    assert roofline_ms(1e6, 1e9, slow) == pytest.approx(20.0)                  # eta_m halves M
    assert roofline_ms(1e9, 1e6, slow) == pytest.approx(80.0)                  # eta_c quarters P
    no_p = DeviceRates(mem_gbs=100.0, compute_gflops=0.0)
    assert roofline_ms(1e12, 1e9, no_p) == pytest.approx(10.0)                 # unknown P: no compute term


def test_l3_blend_eq_4_14(q8):
    M, L3 = 10.0, 30.0
    n = 4
    stage = q8.stage(1, 1 + n)
    w = Workload(prompt_len=1000, output_len=1)
    w_kv = n * w.decode_context * KV_TOKEN                 # eq. 4.12 at the mean decode context
    fast_compute = 1e9                                     # keeps F_attn / P from binding
    for fraction_in_l3 in (1.0, 0.5, 0.25):
        rates = DeviceRates(mem_gbs=M, compute_gflops=fast_compute, l3_bytes=int(w_kv * fraction_in_l3), l3_gbs=L3)
        alpha = min(1.0, rates.l3_bytes / w_kv)
        m_hat = alpha * L3 + (1 - alpha) * M
        t = stage_time(q8, stage, rates, w, blend_l3=True)
        assert t.attn_ms == pytest.approx(w_kv / (m_hat * 1e9) * 1e3, rel=1e-6)
    assert t.attn_ms > stage_time(q8, stage, dataclasses.replace(rates, l3_bytes=int(w_kv)), w, blend_l3=True).attn_ms
    # The GPU stage never blends.
    no_blend = stage_time(q8, stage, rates, w, blend_l3=False)
    assert no_blend.attn_ms == pytest.approx(w_kv / (M * 1e9) * 1e3, rel=1e-6)


def test_measured_attention_rate_replaces_the_l3_blend(q8):
    """A profile that measured helmc's decode attention (cpu.attention_read_gbs) times a CPU block's attention at
    that rate, with no L3 blend: between two tokens every block's weights stream through the L3. Prefill keeps
    eq. 4.14, and a rate of 0 (not measured) keeps the blend."""
    stage = q8.stage(1, 5)
    w = Workload(prompt_len=32768, output_len=16)
    w_kv = 4 * w.decode_context * KV_TOKEN
    blended = DeviceRates(mem_gbs=88.0, compute_gflops=1e9, l3_bytes=300 << 20, l3_gbs=264.0)
    measured = dataclasses.replace(blended, attention_gbs=65.0)
    t = stage_time(q8, stage, measured, w, blend_l3=True)
    assert t.attn_ms == pytest.approx(w_kv / 65e9 * 1e3, rel=1e-9)
    assert t.attn_ms > stage_time(q8, stage, blended, w, blend_l3=True).attn_ms
    pre = Workload(prompt_len=512, output_len=1, objective="prefill")
    assert stage_time(q8, stage, measured, pre, blend_l3=True) == stage_time(q8, stage, blended, pre, blend_l3=True)


def test_attention_compute_term_eq_4_13(q8):
    """With P_dec = M (the thesis's CPU rule), attention at B = 1 is bound by F_attn / P."""
    rates = DeviceRates(mem_gbs=45.0, compute_gflops=45.0, l3_bytes=24 * 2 ** 20, l3_gbs=135.0)
    w = Workload(prompt_len=128, output_len=128)
    t = stage_time(q8, q8.stage(1, 21), rates, w, blend_l3=True)
    f_attn = 4 * 1 * 32 * w.decode_context * 128 * 20                          # eq. 4.11
    assert t.attn_ms == pytest.approx(f_attn / 45e9 * 1e3, rel=1e-9)


def test_comm_eq_4_15(q8, laptop):
    """T_comm = l + W_act / B_link ~ 5 us for 8 KB (thesis 4.1.3); the returning token id adds
    l + 4 B / B_d2h to every plan whose lm_head is on the GPU, all-GPU included."""
    w = Workload()
    split, all_gpu = comm_time_ms(q8, 21, w, laptop.link), comm_time_ms(q8, 0, w, laptop.link)
    crossing_us = (split - all_gpu) * 1e3
    print(f"activation crossing {crossing_us:.2f} us (thesis ~5 us), token return {all_gpu * 1e3:.2f} us")
    assert crossing_us == pytest.approx(4.5 + 8192 / 16e9 * 1e6, rel=1e-9)
    assert round(crossing_us) == 5
    assert all_gpu * 1e3 == pytest.approx(4.5 + 4 / 16e9 * 1e6, rel=1e-9)
    assert comm_time_ms(q8, q8.num_units, w, None) == 0.0
    prefill = comm_time_ms(q8, 21, Workload(objective="prefill", prompt_len=128), laptop.link)
    assert prefill > split                                                     # 128 rows cross at prefill


def test_block_overhead_delta_per_block(q8):
    rates = DeviceRates(mem_gbs=100.0, compute_gflops=0.0, block_overhead_ms=0.5)
    t = stage_time(q8, q8.stage(0, 11), rates, Workload(), blend_l3=False)    # embedding + 10 blocks
    assert t.overhead_ms == pytest.approx(5.0)
    assert t.total_ms == pytest.approx(t.proj_ms + t.attn_ms + 5.0)
    assert stage_time(q8, q8.stage(37, 38), rates, Workload(), blend_l3=False).overhead_ms == 0.0   # head only


def test_block_overhead_scales_with_the_blocks_bytes_where_the_fit_says_its_block(q8, laptop):
    """A delta fitted on blocks of B bytes (cpu.overhead_block_bytes) is charged delta * b / B to a block of b bytes:
    a quantized block's overhead was measured at a fraction of the fp16-fitted delta. Without the figure,
    or where the CPU takes the profile-wide delta, it is charged whole per block, as before."""
    w = Workload()
    load = q8.stage(0, 11)                                                     # embedding + 10 blocks
    assert load.block_param_bytes == 10 * BLOCK_BYTES
    half = dataclasses.replace(laptop.cpu, block_overhead_ms=0.5, overhead_block_bytes=2 * BLOCK_BYTES)
    scaled = stage_time(q8, load, DeviceRates.of_cpu(half), w, blend_l3=True)
    assert scaled.overhead_ms == pytest.approx(10 * 0.5 / 2, rel=1e-12)       # half the fitted block's bytes
    same = dataclasses.replace(half, overhead_block_bytes=BLOCK_BYTES)
    assert stage_time(q8, load, DeviceRates.of_cpu(same), w, blend_l3=True).overhead_ms == pytest.approx(5.0)
    unknown = dataclasses.replace(half, overhead_block_bytes=0)
    assert stage_time(q8, load, DeviceRates.of_cpu(unknown), w, blend_l3=True).overhead_ms == pytest.approx(5.0)
    wide = dataclasses.replace(half, block_overhead_ms=None)                   # the profile-wide delta: per block
    assert DeviceRates.of_cpu(wide, block_overhead_ms=0.5).overhead_block_bytes == 0
    assert stage_time(q8, q8.stage(37, 38), DeviceRates.of_cpu(half), w, blend_l3=True).overhead_ms == 0.0  # head


def test_kv_streams_over_the_link_when_vram_is_short(q8, laptop):
    gpu = DeviceRates.of_gpu(laptop.gpu, 0.0)
    w = Workload(prompt_len=20000, output_len=2000)
    stage = q8.stage(21, 38)
    kv = 16 * w.decode_context * KV_TOKEN
    resident = kv / 4
    t = stage_time(q8, stage, gpu, w, blend_l3=False, kv_resident_bytes=resident, link=laptop.link)
    assert t.kv_stream_ms == pytest.approx((kv - resident) / 16e9 * 1e3, rel=1e-9)
    assert t.attn_ms == pytest.approx(kv / 218e9 * 1e3, rel=1e-9)     # staged pages are read from VRAM too
    assert t.total_ms == pytest.approx(max(t.proj_ms + t.attn_ms, t.kv_stream_ms))
    all_resident = stage_time(q8, stage, gpu, w, blend_l3=False, kv_resident_bytes=kv, link=laptop.link)
    assert all_resident.attn_ms == t.attn_ms and all_resident.kv_stream_ms == 0.0
    assert all_resident.total_ms <= t.total_ms                          # residency only ever removes PCIe time
    with pytest.raises(HelmcError, match="needs a link"):
        stage_time(q8, stage, gpu, w, blend_l3=False, kv_resident_bytes=0.0, link=None)


def test_memory_needs_running_example(q8, laptop):
    """cpu(21) -> cuda(17): 16 blocks + lm_head + activations + KV staging + 1 GB reserve fit in
    8 GiB; one more block does not (eq. 4.16 with the terms the thesis leaves out). The thesis
    prefills on the CPU: stream_prefill=False."""
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    w = Workload(stream_prefill=False)
    head = (151936 * 4096 + 4096) * 2
    host, dev = memory_needs(q8, laptop, q8.stage(0, 21), q8.stage(21, 38), w)
    staging = KVCacheGPU.workspace_bytes(32, 8, 128, KV_PAGE_TOKENS, score_budget_bytes=KV_SCORE_TILE_BYTES)
    assert dev.weights == 16 * BLOCK_BYTES + head
    assert dev.kv == 0 and dev.reserve == 10 ** 9 and dev.available == 8 * 2 ** 30
    assert dev.workspace > staging                                               # activations on top of staging
    assert dev.fits
    print(f"cpu(21): VRAM {dev.total / 2**30:.3f} of {dev.available / 2**30:.3f} GiB; host {host.total / 2**30:.2f} GiB")
    _, dev20 = memory_needs(q8, laptop, q8.stage(0, 20), q8.stage(20, 38), w)
    assert not dev20.fits and dev20.shortfall == dev20.total - dev20.available
    assert host.weights == 151936 * 4096 * 2 + 20 * BLOCK_BYTES
    assert host.kv == (20 + 16) * KV_PAGE_TOKENS * KV_TOKEN                    # offloaded: all KV in host RAM, whole pages
    _, dev_no = memory_needs(q8, laptop, q8.stage(0, 21), q8.stage(21, 38), dataclasses.replace(w, kv_offload=False))
    assert dev_no.kv == 16 * KV_PAGE_TOKENS * KV_TOKEN
    # Streamed prefill borrows the empty KV page pool for one CPU block's weights and the prompt's
    # hidden state [S, H], K/V [2, h_kv, S, d] (fp16) and cos/sin [S, d] (fp32): the pool's floor.
    _, dev_stream = memory_needs(q8, laptop, q8.stage(0, 21), q8.stage(21, 38), dataclasses.replace(w, stream_prefill=True))
    assert dev_stream.workspace == dev.workspace
    assert dev_stream.kv == BLOCK_BYTES + 128 * (4096 * 2 + 2 * 8 * 128 * 2 + 2 * 128 * 4)
    _, dev_stream_no = memory_needs(q8, laptop, q8.stage(0, 21), q8.stage(21, 38),
                                    dataclasses.replace(w, stream_prefill=True, kv_offload=False))
    assert dev_stream_no.kv == max(dev_no.kv, dev_stream.kv)                    # the pool is lent, not added to
    _, head_only = memory_needs(q8, laptop, q8.stage(0, 37), q8.stage(37, 38), dataclasses.replace(w, stream_prefill=True))
    _, head_only_no = memory_needs(q8, laptop, q8.stage(0, 37), q8.stage(37, 38), w)
    assert head_only.workspace - head_only_no.workspace == dev_stream.kv       # no page pool: its own VRAM
    _, all_gpu = memory_needs(q8, laptop, q8.stage(0, 0), q8.stage(0, 38), dataclasses.replace(w, stream_prefill=True))
    _, all_gpu_no = memory_needs(q8, laptop, q8.stage(0, 0), q8.stage(0, 38), w)
    assert all_gpu.workspace == all_gpu_no.workspace                           # no CPU blocks: nothing to stream


def test_max_context(q8, laptop):
    w = Workload(kv_offload=False, stream_prefill=False)
    cpu, gpu = q8.stage(0, 21), q8.stage(21, 38)
    host0, dev0 = memory_needs(q8, laptop, cpu, gpu, w, context=0)
    expect_gpu = (dev0.available - dev0.total) // (16 * KV_TOKEN)
    expect_host = (host0.available - host0.total) // (20 * KV_TOKEN)
    pages = min(expect_gpu, expect_host) // KV_PAGE_TOKENS                      # the caches allocate whole pages
    assert max_context(q8, laptop, cpu, gpu, w) == min(pages * KV_PAGE_TOKENS, 40960)
    # Offloaded: the host holds every block's KV; the 16 GiB preset leaves room for the native window.
    assert max_context(q8, laptop, cpu, gpu, Workload(stream_prefill=False)) == 40960
    tiny = dataclasses.replace(laptop, cpu=dataclasses.replace(laptop.cpu, ram_free_bytes=10 * 2 ** 30))
    host0, _ = memory_needs(q8, tiny, cpu, gpu, Workload(stream_prefill=False), context=0)
    fit = (host0.available - host0.total) // (36 * KV_TOKEN)
    assert max_context(q8, tiny, cpu, gpu, Workload(stream_prefill=False)) == fit // KV_PAGE_TOKENS * KV_PAGE_TOKENS


def test_kv_pool_is_the_watermark_of_what_is_left():
    from helmc.planner.cost_model import MemoryNeed
    assert gpu_kv_resident_bytes(MemoryNeed(weights=6, available=10)) == pytest.approx(0.8 * 4)
    assert gpu_kv_resident_bytes(MemoryNeed(weights=12, available=10)) == 0


def test_page_pool_holds_the_loan_at_zero_slack(q8, laptop):
    """Qwen3-8B cpu(21) | gpu(17), streamed prefill of 128 tokens, a GPU with exactly the VRAM the plan
    needs. The plan's pool is then the loan (one block + prompt buffers), 387,596,800 B: not whole
    32 MiB pages. The old runtime rounded it down to 11 pages (369,098,752 B), the loan did not fit
    and the prefill took VRAM the plan never counted; now the pool holds the loan, not a byte more."""
    from helmc.planner.cost_model import MemoryNeed, kv_page_pool_bytes, prefill_lent_bytes
    from helmc.runtime.gpu_session import kv_pool_bytes
    w = Workload(stream_prefill=True)
    cpu, gpu = q8.stage(0, 21), q8.stage(21, 38)
    loan = prefill_lent_bytes(q8, cpu, gpu, w)
    page = KV_PAGE_TOKENS * 16 * KV_TOKEN                                       # one page of the 16 GPU blocks
    assert (loan, page) == (387_596_800, 33_554_432)
    _, dev = memory_needs(q8, laptop, cpu, gpu, w)
    tight = dataclasses.replace(dev, available=dev.total)                      # zero slack
    plan_pool = kv_page_pool_bytes(tight)
    assert plan_pool == dev.kv == loan
    old_runtime_pool = plan_pool // page * page                               # old: KVCacheGPU rounded it down
    assert old_runtime_pool == 369_098_752 < loan
    assert kv_pool_bytes(plan_pool, loan, free_bytes=plan_pool, page_bytes=page) == loan
    # Slack: whole pages of the plan's pool, still at least the loan.
    roomy = kv_page_pool_bytes(dataclasses.replace(dev, available=dev.total + page))
    assert kv_pool_bytes(roomy, loan, free_bytes=2 * roomy, page_bytes=page) == 12 * page
    # The watermark share (resident KV in the timing model) is a share of the pool (thesis 4.2.2).
    assert gpu_kv_resident_bytes(tight) == pytest.approx(0.8 * loan)
    assert kv_page_pool_bytes(MemoryNeed(kv=7, weights=20, available=10)) == 7   # over budget: the floor stays


def test_serving_holds_the_loan_beside_the_pages(q8, laptop):
    """Batch 8 (`helmc serve --max-batch 8`): newcomers' prompts stream while the running sequences hold pages,
    so the plan counts the loan (one block + 8 prompts' own buffers) beside two pages per sequence, where one
    request's plan lets the loan borrow the empty pool (runtime/serve/batch_model.py carves it out)."""
    from helmc.planner.cost_model import prefill_lent_bytes
    cpu, gpu = q8.stage(0, 21), q8.stage(21, 38)
    one, eight = Workload(stream_prefill=True), Workload(stream_prefill=True, batch=8)
    lent1, lent8 = prefill_lent_bytes(q8, cpu, gpu, one), prefill_lent_bytes(q8, cpu, gpu, eight)
    prompt = lent1 - max(u.stored_bytes for u in q8.units if u.kind == "block")   # one prompt's buffers
    assert prompt > 0 and lent8 == lent1 + 7 * prompt
    page = KV_PAGE_TOKENS * 16 * KV_TOKEN                                       # one page of the 16 GPU blocks
    assert memory_needs(q8, laptop, cpu, gpu, one)[1].kv == lent1
    assert memory_needs(q8, laptop, cpu, gpu, eight)[1].kv == lent8 + 8 * 2 * page
    # Without offload the pages of the whole context, beside the loan; max_context leaves the loan out of them.
    no_off, cpu, gpu = dataclasses.replace(eight, kv_offload=False), q8.stage(0, 27), q8.stage(27, 38)
    ctx = max_context(q8, laptop, cpu, gpu, no_off)
    _, dev = memory_needs(q8, laptop, cpu, gpu, no_off, context=ctx)
    assert ctx > 0 and dev.kv == prefill_lent_bytes(q8, cpu, gpu, no_off) + 8 * ctx * 10 * KV_TOKEN
    assert dev.total <= dev.available
    _, over = memory_needs(q8, laptop, cpu, gpu, no_off, context=ctx + KV_PAGE_TOKENS)      # the GPU binds here
    assert over.total > over.available
    # The runtime's pool of such a plan: the pages' part in whole pages, the loan whole beside it, so the batch
    # model's slots still get their two pages each after it carves the loan out.
    from helmc.runtime.gpu_session import kv_pool_bytes
    cpu, gpu = q8.stage(0, 21), q8.stage(21, 38)
    plan_pool = lent8 + 8 * 2 * page + page // 20                               # a twentieth of a page of slack
    assert kv_pool_bytes(plan_pool, lent8, 1 << 40, page, loan_beside=True) == lent8 + 16 * page
    assert kv_pool_bytes(plan_pool, lent8, 1 << 40, page) < lent8 + 16 * page    # rounded whole: under 2 a slot


def test_serving_counts_the_prefill_score_tiles_once(q8, laptop):
    """Each of 8 slot caches holds its staging pages and split partials for its life, but prefill's score tiles
    come from the allocator's pool for one prompt's attention at a time, so a batch counts them once (counting
    them 8 times: 0.66 GiB of a 7 GiB budget, two blocks' worth, went to tiles never live together)."""
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    from helmc.planner.cost_model import kv_staging_bytes
    one = KVCacheGPU.workspace_bytes(32, 8, 128, KV_PAGE_TOKENS, score_budget_bytes=KV_SCORE_TILE_BYTES)
    tiles = 3 * KV_SCORE_TILE_BYTES
    assert kv_staging_bytes(q8, q8.stage(21, 38), 1) == one
    assert kv_staging_bytes(q8, q8.stage(21, 38), 8) == 8 * (one - tiles) + tiles
    _, d1 = memory_needs(q8, laptop, q8.stage(0, 21), q8.stage(21, 38), Workload(stream_prefill=False))
    _, d8 = memory_needs(q8, laptop, q8.stage(0, 21), q8.stage(21, 38), Workload(stream_prefill=False, batch=8))
    # activations: a prefill step holds one chunk's rows whatever the batch (prefill_many runs the GPU stage
    # sequence by sequence), a batched decode step one row per sequence: 8 rows of 1 here need less than 128 of 1
    assert q8.workspace_bytes(q8.stage(21, 38), 8, 1) < q8.workspace_bytes(q8.stage(21, 38), 1, 128)
    assert d8.workspace - d1.workspace == 7 * (one - tiles)


def test_workload_validation():
    with pytest.raises(HelmcError, match="objective expected"):
        Workload(objective="train")
    with pytest.raises(HelmcError, match="expected >= 1"):
        Workload(batch=0)
    assert Workload(prompt_len=100, output_len=50).decode_context == 125


def test_cpu_m_is_the_gemv_read_of_the_model_weight_types(laptop):
    """A quantized model's CPU blocks stream at its kernels' measured rates (helmc profile's gemv_reads): M is
    sum(bytes) / sum(bytes / M_type) over its linears; a type not measured reads at host_read_gbs."""
    from helmc.hardware.profile import KernelRead
    from helmc.model.spec import LINEAR_NAMES
    mix = ("q4_k",) * 2 + ("q6_k",) + ("q4_k",) * 3 + ("q6_k",)             # q, k, v, o, gate, up, down
    spec = dataclasses.replace(qwen3_spec("Qwen3-8B"), layer_types=(mix,) * 36, head_type="q6_k", embed_type="q4_k")
    a = analyze_program(spec)
    by_type = dict(a.linear_bytes_by_type)
    assert set(by_type) == {"q4_k", "q6_k"} and len(mix) == len(LINEAR_NAMES)
    cpu = dataclasses.replace(laptop.cpu, host_read_gbs=90.0,
                              gemv_reads=(KernelRead("float16", 90.0), KernelRead("q4_k", 36.0), KernelRead("q6_k", 48.0)))
    rates = DeviceRates.of_cpu(cpu, 0.0, a.linear_bytes_by_type)
    assert rates.mem_gbs == pytest.approx(sum(by_type.values()) / (by_type["q4_k"] / 36.0 + by_type["q6_k"] / 48.0))
    assert 36.0 < rates.mem_gbs < 48.0
    # Unquantized weights of a type the profile has no figure for: host_read_gbs (the fp16 GEMV) is M.
    assert DeviceRates.of_cpu(cpu, 0.0, analyze_program(qwen3_spec("Qwen3-8B")).linear_bytes_by_type).mem_gbs == \
        pytest.approx(90.0)
    assert DeviceRates.of_cpu(cpu, 0.0).mem_gbs == 90.0


def test_gpu_m_is_helmcs_gpu_gemv_read_of_the_model_types_and_its_head(laptop):
    """With helmc's GPU GEMV rates per type in the profile (gpu.gemv_reads), the GPU's M is the harmonic mix over the
    model's linears and its lm_head as stored (a Q4_K file's head is often fp16); without them, hbm_gbs, and the
    plan says so among its fallbacks."""
    from helmc.hardware.profile import HardwareProfile, KernelRead
    from helmc.planner.cost_model import rate_fallbacks
    spec = dataclasses.replace(qwen3_spec("Qwen3-8B"), layer_types=(("q4_k",) * 7,) * 36, head_type="",
                               embed_type="")
    a = analyze_program(spec)
    (head_type, head_bytes), = a.head_bytes_by_type
    assert head_type == a.dtype and head_bytes == 151936 * 4096 * 2 and dict(a.linear_bytes_by_type).keys() == {"q4_k"}
    q4 = dict(a.linear_bytes_by_type)["q4_k"]
    gpu = dataclasses.replace(laptop.gpu, gemv_reads=(KernelRead(a.dtype, 240.0), KernelRead("q4_k", 150.0)))
    hw = dataclasses.replace(laptop, gpu=gpu)
    rates = DeviceRates.of_device(hw, "gpu", analysis=a)
    assert rates.mem_gbs == pytest.approx((q4 + head_bytes) / (q4 / 150.0 + head_bytes / 240.0))
    assert 150.0 < rates.mem_gbs < 240.0 and gpu.read_gbs("q6_k") == gpu.hbm_gbs      # a type not measured: hbm
    assert DeviceRates.of_device(laptop, "gpu", analysis=a).mem_gbs == laptop.gpu.hbm_gbs
    assert any("helmc's GPU GEMVs not measured" in f for f in rate_fallbacks(laptop))
    assert not any("helmc's GPU GEMVs not measured" in f for f in rate_fallbacks(hw))
    again = HardwareProfile.from_json(hw.to_json())
    assert again.gpu.gemv_reads == gpu.gemv_reads
    with pytest.raises(HelmcError, match="one-row"):
        dataclasses.replace(laptop.gpu, gemv_reads=(KernelRead("q4_k", 150.0, rows=8),))


def test_batched_decode_reads_at_the_m_row_gemv_rate(laptop):
    """`helmc profile` also times the GEMVs at 8 rows (a batched step of 8 sequences). A GEMV that turns
    compute-bound there reads its weights slower: M at B rows is min(M_1, M_8 * 8 / B), per weight type, so a
    plan for --max-batch 8 charges the CPU blocks what 8 rows cost, and a batch of 2 (still memory-bound at
    M_8 * 4 > M_1) nothing more. A profile without 8-row figures plans as before."""
    from helmc.hardware.profile import KernelRead
    from helmc.planner.search_partition import plan
    reads = (KernelRead("float16", 90.0), KernelRead("float16", 50.0, 8), KernelRead("q4_k", 60.0),
             KernelRead("q4_k", 24.0, 8))
    cpu = dataclasses.replace(laptop.cpu, host_read_gbs=90.0, gemv_reads=reads)
    assert cpu.read_gbs("float16") == 90.0 and cpu.read_gbs("float16", 8) == 50.0
    assert cpu.read_gbs("float16", 2) == 90.0 and cpu.read_gbs("float16", 4) == 90.0   # 50 * 8/4 = 100 > 90
    assert cpu.read_gbs("q4_k", 4) == 48.0 and cpu.read_gbs("q4_k", 16) == 12.0
    assert cpu.read_gbs("q6_k", 8) == 90.0                                              # not measured: M_1
    spec = dataclasses.replace(qwen3_spec("Qwen3-8B"), dtype="float16")
    a = analyze_program(spec)
    assert DeviceRates.of_cpu(cpu, 0.0, a.linear_bytes_by_type, rows=8).mem_gbs == pytest.approx(50.0)
    assert DeviceRates.of_cpu(cpu, 0.0, rows=8).mem_gbs == pytest.approx(50.0)
    with pytest.raises(HelmcError, match="one entry per weight type and row count"):
        dataclasses.replace(cpu, gemv_reads=reads + (KernelRead("float16", 40.0, 8),))
    # Planned for 8 sequences, the CPU's share of a step costs 90/50 of what the one-row figures said.
    hw = dataclasses.replace(laptop, cpu=cpu)
    flat = dataclasses.replace(laptop, cpu=dataclasses.replace(cpu, gemv_reads=reads[:1] + reads[2:3]))
    batched, before = plan(spec, hw, batch=8, hybrid=False), plan(spec, flat, batch=8, hybrid=False)
    assert batched.predictions.t_cpu_ms > before.predictions.t_cpu_ms
    # A plan for a batch says when its CPU figure had no batched GEMV rate behind it.
    assert any("no batched GEMV figures" in f for f in before.predictions.fallbacks)
    assert not any("no batched GEMV figures" in f for f in batched.predictions.fallbacks)
    assert plan(spec, hw, hybrid=False).predictions.t_plan_ms == \
        pytest.approx(plan(spec, flat, hybrid=False).predictions.t_plan_ms)


def test_a_plan_says_which_of_its_profile_figures_are_doubtful(laptop):
    """A figure `helmc profile` measured again and still found implausible travels in the profile (doubtful), and
    every plan made from it names it among its notes."""
    from helmc.planner.cost_model import rate_fallbacks
    why = "the DRAM + PCIe window 29.3 + 53.5 GB/s stayed below 0.90 x the faster side alone after 3 more windows"
    assert not any("doubtful" in f for f in rate_fallbacks(laptop))
    notes = rate_fallbacks(dataclasses.replace(laptop, doubtful=(why,)))
    assert [f for f in notes if "doubtful" in f] == [f"the profile marks a figure doubtful (measure again: helmc "
                                                     f"profile): {why}"]


def test_quantized_prefill_scratch_is_vram_where_the_gpu_prefills_blocks(laptop):
    """A Q4_K model's GPU need holds its prefill functions' fp16 buffers (analyze_program's scratch) wherever the GPU
    runs a block's prefill: its own blocks, or the CPU blocks' streamed prefill; not for a GPU holding only the
    head with the prompt on the CPU; the quantized head's buffer only when serving several sequences. fp16: none."""
    from helmc.planner.cost_model import memory_needs
    spec = dataclasses.replace(qwen3_spec("Qwen3-8B"), layer_types=(("q4_k",) * 7,) * 36, head_type="q6_k")
    a = analyze_program(spec)
    none = dataclasses.replace(a, quantized_prefill_scratch_bytes=0, quantized_head_scratch_bytes=0)
    blocks, head = a.quantized_prefill_scratch_bytes, a.quantized_head_scratch_bytes
    assert blocks == (4096 * 4096 + 12288 * 4096) * 2 and head == 151936 * 4096 * 2

    def extra(k, **kw):
        w = Workload(**kw)
        return (memory_needs(a, laptop, a.stage(0, k), a.stage(k, 38), w)[1].workspace
                - memory_needs(none, laptop, none.stage(0, k), none.stage(k, 38), w)[1].workspace)
    assert extra(21) == blocks                                       # GPU blocks
    assert extra(37, stream_prefill=True) == blocks                  # only the head on the GPU, CPU blocks streamed
    assert extra(37, stream_prefill=False) == 0                      # only the head, the prompt on the CPU
    assert extra(21, batch=4) == blocks + head                       # serving: the head's prefill takes last rows
    q8 = analyze_program(qwen3_spec("Qwen3-8B"))
    assert q8.quantized_prefill_scratch_bytes == 0


def test_a_batch_plans_one_prefill_chunk_of_activations_not_one_per_sequence(q8, laptop):
    """8 sequences' 2048-token prompts never run on the GPU at once (one sequence's chunk at a time), so the GPU's
    activations are one chunk's, or a batched decode step's where that is larger: with 8 chunks counted, a MoE
    serving plan gave ~2 GiB of an 8 GiB budget to activations and kept 432 experts in VRAM instead of 1056."""
    from helmc.planner.cost_model import gpu_activation_bytes
    gpu = q8.stage(21, 38)
    w1, w8 = Workload(prompt_len=2048, stream_prefill=False), Workload(prompt_len=2048, stream_prefill=False, batch=8)
    chunk = min(2048, w8.prefill_chunk_tokens)
    assert gpu_activation_bytes(q8, gpu, w8) == gpu_activation_bytes(q8, gpu, w1) == q8.workspace_bytes(gpu, 1, chunk)
    wide = Workload(prompt_len=2, stream_prefill=False, batch=8)        # a 2-token prompt: the decode step is larger
    assert gpu_activation_bytes(q8, gpu, wide) == q8.workspace_bytes(gpu, 8, 1) > q8.workspace_bytes(gpu, 1, 2)
