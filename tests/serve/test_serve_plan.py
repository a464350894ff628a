"""The plan is made for the batch the server runs (`helmc build --max-batch`): the planner counts the KV of every
sequence, so a plan for 8 holds an eighth of the context per sequence in the same memory."""
from helmc import api
from helmc.planner.cost_model import KV_PAGE_TOKENS
from qwen3_configs import write_config


def test_plan_counts_every_sequence_of_the_batch(tmp_path):
    d = write_config(str(tmp_path), "Qwen3-8B")
    one = api.plan(d, "rtx4060-laptop", batch=1, kv_offload=False, gpu_budget_gib=7).plan
    eight = api.plan(d, "rtx4060-laptop", batch=8, kv_offload=False, gpu_budget_gib=7).plan
    assert (one.workload.batch, eight.workload.batch) == (1, 8)
    print(f"Qwen3-8B on rtx4060-laptop: max context {one.memory.max_context} at batch 1, {eight.memory.max_context} per sequence at 8")
    assert 0 < eight.memory.max_context <= one.memory.max_context // 8 + KV_PAGE_TOKENS


def test_plan_and_serve_options_are_checked_before_anything_is_read(tmp_path):
    import pytest
    from helmc.errors import HelmcError
    d = write_config(str(tmp_path), "Qwen3-8B")
    by_options = api.plan(d, "rtx4060-laptop", api.PlanOptions(batch=8, kv_offload=False, gpu_budget_gib=7))
    assert by_options.plan == api.plan(d, "rtx4060-laptop", batch=8, kv_offload=False, gpu_budget_gib=7).plan
    assert by_options.plan.workload.prompt_len == api.PLAN_DEFAULTS.prompt_len == api.BUILD_DEFAULTS.prompt_len
    assert f"{by_options.plan.predictions.t_plan_ms:.2f}" in by_options.table()
    assert by_options.to_json_dict()["plan"] == by_options.plan.describe()
    with pytest.raises(HelmcError, match="expected a PlanOptions or its fields as keywords, found both"):
        api.plan(d, "rtx4060-laptop", api.PlanOptions(), batch=2)
    with pytest.raises(HelmcError, match="plan options: expected keywords among .* found bach"):
        api.plan(d, "rtx4060-laptop", bach=2)
    for fields, line in (({"port": 70000}, "--port expected in [0, 65535]"), ({"max_batch": 0}, "--max-batch expected"),
                         ({"log_level": "loud"}, "--log-level expected one of")):
        with pytest.raises(HelmcError, match=line.replace("[", r"\[").replace("]", r"\]")):
            api.ServeOptions(**fields)
