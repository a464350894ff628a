"""A Plan is made of parts, one a job (placement, predictions, memory, workload, provenance), each refusing what
breaks its own invariants; plan.json is those parts, and a plan.json of the flat format before them reads the same."""
import dataclasses
import json

import pytest

from helmc.errors import HelmcError
from helmc.runtime.bundle.plan import (PARTS, PLAN_FORMAT_VERSION, MemoryBudget, Placement, Plan, PlanGroup,
                                       PlanWorkload, Predictions, Provenance)


def _plan() -> Plan:
    return Plan.of(num_layers=4, cpu_units=2, t_cpu_ms=1.0, t_gpu_ms=2.0, t_comm_ms=0.5, t_plan_ms=3.5,
                   max_context=256, gpu_bytes=1 << 30, gpu_kv_pool_bytes=1 << 20, prefill_on_gpu=True,
                   prefill_staging_bytes=4096, prefill_chunk_tokens=128, batch=2, prompt_len=64, output_len=32,
                   hardware_hash="hw", architecture_hash="arch", gpu_experts=((0,), (), (1, 3), ()))


def test_each_field_lives_in_one_part_and_the_plan_reads_none_flat():
    p = _plan()
    assert p.placement == Placement(num_layers=4, cpu_units=2, gpu_experts=((0,), (), (1, 3), ()), prefill_on_gpu=True,
                                    prefill_chunk_tokens=128)
    assert p.predictions == Predictions(t_cpu_ms=1.0, t_gpu_ms=2.0, t_comm_ms=0.5, t_plan_ms=3.5)
    assert p.memory == MemoryBudget(max_context=256, gpu_bytes=1 << 30, gpu_kv_pool_bytes=1 << 20,
                                    prefill_staging_bytes=4096)
    assert p.workload == PlanWorkload(prompt_len=64, output_len=32, batch=2)
    assert p.provenance == Provenance("hw", "arch")
    names = [f.name for cls in PARTS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))                                  # a name routes to exactly one part
    assert not any(hasattr(p, n) for n in names)                          # nothing reads a part's field off Plan
    assert (p.placement.cpu_layers, p.placement.gpu_layers, p.placement.head_on_gpu) == (range(0, 1), range(1, 4), True)
    assert p.describe() == "cpu(2) -> cuda(4)" and p.tokens_per_s == pytest.approx(2e3 / 3.5)
    q = p.replace(cpu_units=3, t_cpu_ms=2.0, t_plan_ms=4.5)
    assert (q.placement.cpu_units, q.predictions.t_plan_ms, q.memory, q.workload) == (3, 4.5, p.memory, p.workload)
    with pytest.raises(HelmcError, match="plan.replace: expected fields of placement, predictions, memory, workload, "
                                         "provenance, found 'cpu_unit'"):
        p.replace(cpu_unit=3)


@pytest.mark.parametrize("make, words", [
    (lambda: Placement(num_layers=4, cpu_units=7), "plan placement: cpu_units expected 0..6, found 7"),
    (lambda: Placement(num_layers=4, cpu_units=6, prefill_on_gpu=True), "prefill_on_gpu expected only with CPU "
                                                                         "blocks and a GPU stage"),
    (lambda: Placement(num_layers=2, cpu_units=2, gpu_experts=((1, 0), ())), "gpu_experts of block 0 expected "
                                                                             "increasing"),
    (lambda: Placement(num_layers=4, cpu_units=3, groups=(PlanGroup("streamed", 0, 2),)),
     "groups expected to alternate cpu, streamed"),
    (lambda: Predictions(t_cpu_ms=1.0, t_plan_ms=2.0), "t_plan_ms expected t_cpu \\+ t_gpu \\+ t_comm"),
    (lambda: MemoryBudget(max_context=-1, gpu_kv_pool_bytes=-2), "plan memory: max_context, gpu_kv_pool_bytes "
                                                                 "expected >= 0, found -1, -2"),
    (lambda: PlanWorkload(batch=0), "plan workload: expected batch >= 1"),
    (lambda: PlanWorkload(objective="latency"), "objective expected one of \\('decode', 'prefill'\\), found "
                                                "'latency'"),
    (lambda: Provenance(hardware_hash=3), "hardware_hash and architecture_hash expected strings"),
    (lambda: _plan().replace(prefill_staging_bytes=0), "prefill_on_gpu expected VRAM to stage a block"),
    (lambda: Plan(Placement(num_layers=1, cpu_units=0), memory=Predictions()), "plan: memory expected a MemoryBudget"),
])
def test_each_part_refuses_what_breaks_its_invariants(make, words):
    with pytest.raises(HelmcError, match=words):
        make()


def test_plan_json_is_the_parts_and_the_flat_format_reads_the_same():
    p = _plan()
    d = json.loads(p.to_json())
    assert set(d) == {"format_version", *PARTS} and d["format_version"] == PLAN_FORMAT_VERSION == 2
    assert d["placement"]["cpu_units"] == 2 and d["memory"]["max_context"] == 256 and d["workload"]["batch"] == 2
    assert Plan.from_json(p.to_json()) == p
    flat = {"format_version": 1}
    for part in PARTS:
        flat.update(d[part])
    assert Plan.from_json(json.dumps(flat)) == p
    with pytest.raises(HelmcError, match="plan: unknown key 'cpu_unit' in a plan of format 1"):
        Plan.from_json(json.dumps({**flat, "cpu_unit": 2}))
    for version in (0, 3, None):
        with pytest.raises(HelmcError, match=f"plan: format_version expected 2 \\(or 1, read into the parts\\), found "
                                              f"{version}"):
            Plan.from_json(json.dumps({**d, "format_version": version}))
    d["placement"]["cpu_units"] = 9
    with pytest.raises(HelmcError, match="cpu_units expected 0..6, found 9"):
        Plan.from_json(json.dumps(d))
