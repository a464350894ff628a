"""The plan is made for the batch the server runs (`helmc build --max-batch`): the planner counts the KV of every
sequence, so a plan for 8 holds an eighth of the context per sequence in the same memory."""
from helmc import api
from helmc.planner.cost_model import KV_PAGE_TOKENS
from qwen3_configs import write_config


def test_plan_counts_every_sequence_of_the_batch(tmp_path):
    d = write_config(str(tmp_path), "Qwen3-8B")
    one = api.plan(d, "rtx4060-laptop", batch=1, kv_offload=False, gpu_budget_gib=7).plan
    eight = api.plan(d, "rtx4060-laptop", batch=8, kv_offload=False, gpu_budget_gib=7).plan
    assert (one.batch, eight.batch) == (1, 8)
    print(f"Qwen3-8B on rtx4060-laptop: max context {one.max_context} at batch 1, {eight.max_context} per sequence at 8")
    assert 0 < eight.max_context <= one.max_context // 8 + KV_PAGE_TOKENS
