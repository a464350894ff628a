"""The engine's warm-up at load (runtime/serve/warmup.py): every decode batch size the engine can reach runs once on
dummy prompts, every slot's CPU KV is committed, and afterwards every slot and page pool is empty, the outputs are
bit-identical to an engine loaded without it, and the GC's view of what loading made is frozen. A real tiny
Qwen3 bundle built for 4 sequences on the CPU (variants decode_b2, decode_b4); nothing mocked."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from tiny_shapes import KQUANT_DIMS

pytest.importorskip("tvm.relax")
MAX_BATCH = 4


@pytest.fixture(scope="module")
def bundle(tiny):
    # the batched CPU bundle tests/runtime/test_batch_decode_cpu.py checks too: built once per session
    r = tiny.build("qwen3", "float16", batch=MAX_BATCH, cpu_only=True, **KQUANT_DIMS)
    assert r.plan.workload.batch == MAX_BATCH and r.plan.placement.cpu_units == r.spec.num_units
    return r.bundle_dir


def _model(bundle, max_batch=MAX_BATCH):
    from helmc.runtime.serve.batch_model import BatchModel
    from helmc.runtime.session import Session
    return BatchModel(Session.load(bundle), max_batch)


def test_warm_up_runs_every_batch_size_and_leaves_every_slot_empty(bundle):
    from helmc.runtime.serve import warmup
    m = _model(bundle)
    steps, lines = [], []
    decode = m.decode
    m.decode = lambda slots, tokens: steps.append(len(slots)) or decode(slots, tokens)
    out = warmup.warm_up(m, lines.append)
    assert sorted(out["sizes"]) == [1, 2, 4]
    assert steps == [1] * warmup.DECODE_STEPS + [2] * warmup.DECODE_STEPS + [4] * warmup.DECODE_STEPS, steps
    assert m.pages_in_use() == 0
    assert all(m.length(s) == 0 for s in range(MAX_BATCH))
    stage = m.session.cpu_stage
    assert {2, 4} <= set(stage._decode_batch._bufs)                  # the per-size buffers exist before any request
    assert all(kv._kernel_args is not None for kv in m.cpu_caches)   # every slot's kernel tensors bound
    kv = m.cpu_caches[0]
    tokens = m.session.plan.workload.prompt_len + m.session.plan.workload.output_len
    assert out["kv_bytes"] == MAX_BATCH * kv.num_layers * 2 * kv.num_kv_heads * tokens * kv.head_dim * kv.dtype.itemsize
    assert any("decode_b4" in line for line in lines) and any("committed" in line for line in lines), lines


def test_a_smaller_max_batch_warms_the_padded_variants(bundle):
    from helmc.runtime.serve import warmup
    m = _model(bundle, 3)
    assert warmup.batch_sizes(m) == [1, 2, 3]        # 3 sequences run decode_b4 on a padded row
    warmup.warm_up(m)
    assert m.pages_in_use() == 0


def test_warm_up_refuses_a_slot_that_holds_a_request(bundle):
    from helmc.errors import HelmcError
    from helmc.runtime.serve import warmup
    m = _model(bundle)
    m.prefill(1, [5, 6, 7])
    with pytest.raises(HelmcError, match="expected every slot empty before"):
        warmup.warm_up(m)
    assert m.length(1) == 3                            # left as it was
    with pytest.raises(HelmcError, match="expected an empty cache"):
        m.cpu_caches[1].prefault(16)


def test_outputs_after_warm_up_are_bitwise_those_without(bundle):
    from helmc.runtime.serve import warmup
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(1, 500, size=n)] for n in (5, 12, 3, 9)]
    logits = []
    for warm in (False, True):
        m = _model(bundle)
        if warm:
            warmup.warm_up(m)
        rows = [[r] for r in m.prefill_many(list(enumerate(prompts)))]
        for _ in range(6):
            for b, r in enumerate(m.decode(list(range(4)), [int(np.argmax(x[-1])) for x in rows])):
                rows[b].append(r)
        logits.append(np.stack([np.stack(r) for r in rows]))
    assert logits[0].view(np.uint32).tolist() == logits[1].view(np.uint32).tolist()


def test_load_engine_warms_up_and_freezes_the_gc(bundle, capsys):
    from helmc.runtime.sampling import SamplingParams
    from helmc.runtime.serve.load import load_engine
    from helmc.runtime.serve.protocol import Request
    gc.unfreeze()
    try:
        engine, _ = load_engine(bundle, quiet=False)
        assert gc.get_freeze_count() > 0
        assert engine.model.pages_in_use() == 0 and engine.steps == 0
        err = capsys.readouterr().err
        assert "warm-up: 4 sequences (decode_b4)" in err, err
        done = {}
        engine.submit(Request("r", (3, 4, 5), SamplingParams(max_tokens=4, ignore_eos=True)),
                      lambda c: done.setdefault("t", []).extend(c.token_ids))
        while engine._running or engine.scheduler.waiting or not done:
            engine.step()
        assert len(done["t"]) == 4 and engine.model.pages_in_use() == 0
    finally:
        gc.unfreeze()
    cold, _ = load_engine(bundle, warm_up=False)
    assert gc.get_freeze_count() == 0 and cold.model.session.cpu_stage._decode_batch is None
