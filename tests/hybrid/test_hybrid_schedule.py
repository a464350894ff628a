"""Hybrid decode's bookkeeping on the CPU, with exact values: ring slots and KV indices of a plan's
groups, the per-token order of copies, events and crossings, the invariants every order must keep, the forced
layouts the device checks build, and where the streamed prefill puts each block's K, V."""
import dataclasses

import pytest

from helmc.errors import HelmcError
from helmc.runtime.bundle.plan import Plan, PlanGroup
from helmc.runtime.hybrid.schedule import (ARENA_ALIGN, HybridSchedule, Op, Pair, RingSlot, check_ops, schedule_of,
                                           token_ops)


def hybrid_plan(pairs, num_layers, ring=10_000) -> Plan:
    groups, first = [], 0
    for c, s in pairs:
        groups += [PlanGroup("cpu", first, c, 1000 * c), PlanGroup("streamed", first + c, s, 1000 * s)]
        first += c + s
    return Plan.of(num_layers=num_layers, cpu_units=first + 1, max_context=64,
                groups=tuple(groups), staging_ring_bytes=ring)


def test_slots_kv_indices_and_ops_of_two_pairs():
    # C0 [0] S0 [1, 2] C1 [3] S1 [4] | resident [5]; arenas of 1000 B take 1024-byte slots.
    s = schedule_of(hybrid_plan(((1, 2), (1, 1)), num_layers=6), lambda layer: 1000)
    assert ARENA_ALIGN == 256
    assert s.pairs == (Pair(0, (0,), 0, (RingSlot(1, 0, 1000), RingSlot(2, 1024, 1000)), 0),
                       Pair(1, (3,), 1, (RingSlot(4, 0, 1000),), 2))
    assert s.ring_bytes == 2048
    assert s.resident_layers == (5,)
    assert s.streamed_layers == (1, 2, 4) and s.cpu_layers == (0, 3)
    assert s.gpu_kv_layers == (1, 2, 4, 5)                # GPU cache: streamed blocks first, then resident
    assert [(o.kind, o.pair) for o in s.ops] == [
        ("begin", -1),
        ("copy", 0), ("cpu", 0), ("to_gpu", 0), ("wait_copy", 0), ("gpu", 0), ("release_ring", 0), ("to_host", 0),
        ("copy", 1), ("cpu", 1), ("to_gpu", 1), ("wait_copy", 1), ("gpu", 1), ("release_ring", 1),
        ("resident", -1), ("finish", -1)]
    assert s.crossings == 3                                # 2 pairs: there, back, there
    assert s.describe() == "C0[0] S0[1..2] C1[3] S1[4] | resident [5], ring 0.0 MiB"


def test_uneven_arenas_and_no_resident_blocks():
    # Blocks of two type signatures (a Q4_K_M file) have arenas of different sizes: slots follow each one's.
    sizes = {1: 700, 2: 300, 3: 256, 5: 1}
    s = schedule_of(hybrid_plan(((1, 3), (1, 1)), num_layers=6), sizes.__getitem__)
    assert s.pairs[0].slots == (RingSlot(1, 0, 700), RingSlot(2, 768, 300), RingSlot(3, 1280, 256))
    assert s.pairs[1].slots == (RingSlot(5, 0, 1),)
    assert s.ring_bytes == 1536 and s.resident_layers == () and s.gpu_kv_layers == (1, 2, 3, 5)
    assert s.pairs[0].copy_bytes == 1256
    assert [o.kind for o in s.ops if o.pair == 1] == ["copy", "cpu", "to_gpu", "wait_copy", "gpu", "release_ring"]


def test_one_pair_has_one_crossing():
    s = schedule_of(hybrid_plan(((2, 1),), num_layers=4), lambda layer: 512)
    assert s.crossings == 1 and s.ring_bytes == 512 and s.resident_layers == (3,)
    assert s.pairs == (Pair(0, (0, 1), 0, (RingSlot(2, 0, 512),), 0),)


def test_a_plain_split_has_no_schedule():
    plain = Plan.of(num_layers=4, cpu_units=2, max_context=64)
    with pytest.raises(HelmcError, match="expected a plan with streamed groups"):
        schedule_of(plain, lambda layer: 1)


@pytest.mark.parametrize("swap, why", [
    ((("copy", 1), ("release_ring", 0)), "overwrites the ring before pair 0's last read"),
    ((("wait_copy", 0), ("gpu", 0)), "copy < wait_copy < gpu"),
    ((("cpu", 1), ("to_host", 0)), "previous streamed group's output back first"),
    ((("to_gpu", 0), ("cpu", 0)), "the CPU group, then the crossing"),
])
def test_orders_that_break_an_invariant_are_refused(swap, why):
    ops = list(token_ops(2))
    i, j = (ops.index(Op(k, p)) for k, p in swap)
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(HelmcError, match=why):
        check_ops(tuple(ops), 2)


def test_missing_or_repeated_ops_are_refused():
    ops = token_ops(2)
    with pytest.raises(HelmcError, match="expected exactly"):
        check_ops(tuple(o for o in ops if o != Op("to_host", 0)), 2)
    with pytest.raises(HelmcError, match="twice"):
        check_ops(ops[:3] + (Op("cpu", 0),) + ops[3:], 2)
    with pytest.raises(HelmcError, match="kind expected"):
        Op("prefetch", 0)


def test_constructed_schedules_check_their_slots_and_bases():
    good = schedule_of(hybrid_plan(((1, 2), (1, 1)), num_layers=6), lambda layer: 1000)
    with pytest.raises(HelmcError, match="ring_bytes expected the largest group's slots, 2048"):
        dataclasses.replace(good, ring_bytes=4096)
    with pytest.raises(HelmcError, match="slot of block 2 expected at offset 1024"):
        Pair(0, (0,), 0, (RingSlot(1, 0, 1000), RingSlot(2, 1000 // 256 * 256, 1000)), 0)
    with pytest.raises(HelmcError, match="multiple of 256"):
        RingSlot(1, 100, 10)
    with pytest.raises(HelmcError, match="consecutive blocks"):
        Pair(0, (0,), 0, (RingSlot(2, 0, 10),), 0)
    bad = dataclasses.replace(good.pairs[1], gpu_kv_base=1)
    with pytest.raises(HelmcError, match="pair 1 expected to start at block 3 with KV bases"):
        HybridSchedule((good.pairs[0], bad), good.resident_layers, good.ring_bytes, good.ops)
    with pytest.raises(HelmcError, match="resident blocks expected to follow block 4"):
        HybridSchedule(good.pairs, (6,), good.ring_bytes, good.ops)


def test_forced_layouts_make_valid_plans():
    from helmc.planner.analyze_program import analyze_program
    from helmc.planner.hybrid import forced_layout, forced_split
    from qwen3_configs import qwen3_spec

    spec = qwen3_spec("Qwen3-8B", torch_dtype="float16", num_hidden_layers=6)
    block = analyze_program(spec).units[1].stored_bytes
    base = Plan.of(num_layers=6, cpu_units=0, t_gpu_ms=3.0, t_comm_ms=0.5,
                t_plan_ms=3.5, max_context=256, prefill_chunk_tokens=128, gpu_kv_pool_bytes=1 << 30)
    h = forced_layout(base, spec, ((1, 2), (1, 1)))
    assert h.placement.cpu_units == 6 and h.placement.is_hybrid and h.placement.streamed_layers == (1, 2, 4) and h.placement.cpu_compute_layers == (0, 3)
    assert [(g.kind, g.first_layer, g.num_layers, g.weight_bytes) for g in h.placement.groups] == [
        ("cpu", 0, 1, block), ("streamed", 1, 2, 2 * block), ("cpu", 3, 1, block), ("streamed", 4, 1, block)]
    assert h.memory.staging_ring_bytes == 2 * block and h.placement.prefill_on_gpu and h.memory.prefill_staging_bytes == block
    assert Plan.from_json(h.to_json()) == h                      # what the bundle stores reads back the same
    plain = forced_split(base, spec, 2)
    assert (plain.placement.cpu_units, plain.placement.is_hybrid, plain.placement.prefill_on_gpu, plain.memory.prefill_staging_bytes) == (2, False, True, block)
    assert plain.placement.groups == () and plain.memory.staging_ring_bytes == 0
    with pytest.raises(HelmcError, match="forced hybrid layout"):
        forced_layout(base, spec, ((1, 0),))


def test_prefill_puts_streamed_blocks_kv_in_the_gpu_cache():
    from helmc.runtime.hybrid.load import prefill_kv_targets

    class Arena:
        def __init__(self, layer):
            self.layer = layer

    s = schedule_of(hybrid_plan(((1, 2), (1, 1)), num_layers=6), lambda layer: 1000)
    assert prefill_kv_targets(s, [Arena(i) for i in range(5)]) == (
        ("cpu", 0), ("gpu", 0), ("gpu", 1), ("cpu", 1), ("gpu", 2))


def test_prefill_stream_alignment_matches():
    from helmc.runtime.prefill_stream import ARENA_ALIGN as PREFILL_ALIGN
    assert PREFILL_ALIGN == ARENA_ALIGN


def test_builds_search_hybrid_only_where_the_runtime_runs_it():
    from helmc.compiler import pipeline
    assert pipeline.BUILD_HYBRID
    assert pipeline.hybrid_allowed(True, stream_prefill=True, batch=1)
    assert not pipeline.hybrid_allowed(False, stream_prefill=True, batch=1)          # --no-hybrid
    assert not pipeline.hybrid_allowed(True, stream_prefill=False, batch=1)          # prefill must stream
    assert pipeline.hybrid_allowed(True, stream_prefill=True, batch=4)               # serving: runtime/hybrid/batch


def test_bench_decode_reports_a_hybrid_bundle(tmp_path):
    # benchmarks.measured_rates.hybrid_fields on a stand-in session: the ring's bytes per token, their PCIe rate, the
    # host weights' rate (the host units' weights and one embedding row a token, not the embedding table) and its
    # share of the profile's DRAM + PCIe rate.
    import json
    from types import SimpleNamespace

    from benchmarks.measured_rates import hybrid_fields
    from qwen3_configs import qwen3_spec

    from helmc.planner.analyze_program import analyze_program
    s = schedule_of(hybrid_plan(((1, 2), (1, 1)), num_layers=6), lambda layer: 1000)
    (tmp_path / "hardware.json").write_text(json.dumps({"link": {"h2d_concurrent_gbs": 40.0,
                                                                 "cpu_read_concurrent_gbs": 80.0}}))
    spec = qwen3_spec("Qwen3-8B")
    session = SimpleNamespace(bundle_dir=str(tmp_path), spec=spec, gpu=SimpleNamespace(hybrid=SimpleNamespace(
        schedule=s, tokens=10, backend=SimpleNamespace(bytes_copied=10 * 3000))))
    plan = SimpleNamespace(predictions=SimpleNamespace(t_copy_ms=0.5), placement=SimpleNamespace(cpu_units=6))                 # the embedding and blocks 0-4 on the host
    out = hybrid_fields(session, plan, per_token_ms=100.0)
    assert out["streamed_bytes_per_token"] == 3000 and out["hybrid_pairs"] == 2 and out["streamed_blocks"] == 3
    assert out["pcie_gbs"] == pytest.approx(3000 / 0.1 / 1e9)
    block = spec.block_weight_bytes(0)
    read = 5 * block + spec.hidden_size * 2                             # fp16: 5 blocks and one embedding row
    assert analyze_program(spec).stage(0, 6).stored_bytes > read + 1e9    # the table is 1.2 GB of what is stored
    assert out["host_weight_gbs"] == pytest.approx(read / 0.1 / 1e9)
    assert out["share_of_dram_pcie"] == pytest.approx(read / 0.1 / 1e9 / 120.0)
