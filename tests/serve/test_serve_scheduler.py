"""The continuous-batching bookkeeping (runtime/serve/scheduler.py) with exact ids: no model, no threads."""
import pytest

from helmc.errors import HelmcError
from helmc.runtime.sampling import SamplingParams
from helmc.runtime.serve.protocol import OpenAIError, Request
from helmc.runtime.serve.scheduler import Scheduler


def req(rid, prompt=4, max_tokens=4):
    return Request(rid, tuple(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))


def test_admits_in_order_into_the_lowest_free_slot():
    s = Scheduler(max_batch=2, page_tokens=4, slot_tokens=16)
    for rid in "abc":
        s.submit(req(rid))
    assert [(r.request_id, slot) for r, slot in s.admit()] == [("a", 0), ("b", 1)]
    assert [r.request_id for r in s.waiting] == ["c"] and s.admit() == []
    assert s.pages_in_use == 4                         # 8 tokens each = 2 pages of 4
    assert s.finish("b") == 1
    assert [(r.request_id, slot) for r, slot in s.admit()] == [("c", 1)]
    assert s.finish("a") == 0 and s.finish("c") == 1
    assert s.idle and s.pages_in_use == 0 and s.free_slots == 2


def test_pages_bound_admission_first_come_first_served():
    s = Scheduler(max_batch=3, page_tokens=4, slot_tokens=16, pool_pages=5)
    s.submit(req("big", prompt=8, max_tokens=8))       # 4 pages
    s.submit(req("next", prompt=4, max_tokens=4))      # 2 pages: does not fit beside big
    s.submit(req("small", prompt=1, max_tokens=3))     # 1 page: would fit, but waits its turn behind "next"
    assert [r.request_id for r, _ in s.admit()] == ["big"]
    assert s.admit() == [] and s.pages_in_use == 4
    s.finish("big")
    assert [r.request_id for r, _ in s.admit()] == ["next", "small"]
    assert s.pages_in_use == 3


def test_cancel_while_waiting_and_unknown_ids():
    s = Scheduler(max_batch=1, page_tokens=4, slot_tokens=16)
    s.submit(req("a"))
    s.submit(req("b"))
    s.admit()
    assert s.finish("b") is None and not s.waiting     # a waiting request just leaves the queue
    assert s.finish("nobody") is None
    assert s.finish("a") == 0 and s.idle


def test_refuses_what_can_never_fit():
    s = Scheduler(max_batch=2, page_tokens=4, slot_tokens=16, pool_pages=3)
    with pytest.raises(OpenAIError, match="prompt: expected at most 15 tokens") as e:
        s.submit(req("long", prompt=16, max_tokens=1))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(OpenAIError, match="need 17 tokens of context, this model's is 16"):
        s.submit(req("over", prompt=10, max_tokens=7))
    with pytest.raises(OpenAIError, match="need 4 KV pages, the pool has 3"):
        s.submit(req("pool", prompt=10, max_tokens=6))
    s.submit(req("ok", prompt=10, max_tokens=2))
    with pytest.raises(HelmcError, match="already queued"):
        s.submit(req("ok"))
    assert [r.request_id for r in s.waiting] == ["ok"]


def test_newcomers_stream_together_while_their_buffers_fit_the_loan():
    """BatchModel's joint streamed prefill: prompts in arrival order share a crossing of the CPU blocks while the
    block arena plus their buffers fit the loan; a prompt too long for the loan goes alone; one-token prompts are
    not streamed (they decode)."""
    from helmc.runtime.prefill_stream import streamed_prefill_bytes
    from helmc.runtime.serve.batch_model import loan_groups

    class Spec:                                    # Qwen3-8B's sizes: all streamed_prefill_bytes reads of a spec
        hidden_size, num_kv_heads, head_dim, rope_width = 4096, 8, 128, 128
    arena = 400 << 20
    size = lambda lengths: streamed_prefill_bytes(arena, lengths, Spec)        # noqa: E731
    loan = size([128] * 4)                                                      # planned: 4 prompts of 128
    assert loan_groups([128, 128, 1, 128, 128, 128], size, loan) == [[0, 1, 3, 4], [5]]
    assert loan_groups([100, 60, 200, 1], size, loan) == [[0, 1, 2]]
    assert loan_groups([2000, 5, 5], size, loan) == [[0], [1, 2]]             # 2000 tokens: alone, over the loan
    assert loan_groups([1, 1], size, loan) == []
    assert size([128]) < loan and size([2000]) > loan
