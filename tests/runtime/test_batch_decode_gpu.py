"""Batch-invariant batched decode through a CPU + GPU split on the GPU: every sequence of a batched
decode step (BatchModel: the CPU stage's and the GPU stage's decode_b{B} variants on padded rows, the head's on
the GPU) gets logits bit-identical to its single-request run (Session.forward, the captured decode graph), for
fp16, bf16, Q4_K_M and Q8_0 weights: the GPU stage's own m-row GEMVs (schedules/gpu/gemv.py, quant_gemv.py)
form every row as their one-row calls do.

The bundles (tiny Qwen3, split cpu(2) -> cuda(rest), --max-batch 4) are built on the compiler machine by
    python -m tests.device.build_batch_session_bundles .devrt/batch_session
and carried to the GPU machine; the test looks in $HELMC_GPU_BATCH_BUNDLES (default .devrt/batch_session).
Imports no compiler: it runs with the runtime-only TVM (TVM_USE_RUNTIME_LIB=1).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from batch_decode_checks import batched_runs, compare, prompts, single_runs
from tests.gpu_prebuilt import prebuilt_dir

pytestmark = pytest.mark.gpu

STEPS = 16


def bundle(name: str) -> str:
    sub = os.path.join(name, "bundle")
    return os.path.join(prebuilt_dir("HELMC_GPU_BATCH_BUNDLES", "batch_session", os.path.join(sub, "manifest.json"),
                                     f"GPU test bundle {sub}", "build_batch_session_bundles .devrt/batch_session"), sub)


@pytest.mark.parametrize("name", ["fp16", "bf16", "q4_k_m", "q8_0", "fp16_streamed", "fp16_hybrid"])
def test_batched_decode_is_bitwise_single_decode_on_gpu(name):
    from helmc.runtime.session import Session
    s = Session.load(bundle(name))
    assert s.gpu is not None and s.gpu.stage is not None and s.cpu_stage is not None, "expected a CPU + GPU split"
    assert s.plan.workload.batch == 4 and s.gpu.stage.batch_sizes == (2, 4)
    ps = prompts(s.spec.vocab_size, 6)
    singles = single_runs(s, ps, STEPS)
    graph = s.gpu.decode_graph
    assert graph is None or graph.replays > 0, "the single runs were expected to replay the decode graph"
    batched, sizes = batched_runs(s, ps, STEPS, max_batch=4, stagger=1)
    assert {1, 2, 3, 4} <= set(sizes), sizes
    compare(singles, batched, f"{name} on the GPU")
    print(f"{name}: {len(ps)} sequences, batched decode steps of {sorted(set(sizes))} sequences, "
          f"every logit bit-identical to the single runs")
    if name == "fp16_hybrid":      # the streamed groups' batched steps replayed as CUDA graphs (hybrid/batch_graph.py)
        graphs = s.gpu._batch_decode.backend.graphs
        assert graphs is not None and not graphs.disabled, graphs and graphs.disabled
        print(f"batched streamed-group graphs: {graphs.stats()}")
        assert graphs.captures > 0 and graphs.replays > 0, graphs.stats()


@pytest.mark.parametrize("name", ["fp16_streamed", "fp16_hybrid"])
def test_joint_streamed_prefill_is_bitwise_single_on_gpu(name):
    """Newcomers' prompts through the streamed prefill together (BatchModel.prefill_many on a plan with
    prefill_on_gpu): the CPU block's weights cross PCIe once for all of them, and each prompt's logits are
    bit-identical to its single request's (Session.forward, whose prefill streams the same block alone). The
    hybrid plan's streamed block puts each prompt's K, V in that prompt's slot of the GPU cache."""
    from helmc.runtime.serve.batch_model import BatchModel
    from helmc.runtime.session import Session
    s = Session.load(bundle(name))
    assert s.plan.placement.prefill_on_gpu and s.gpu.streamed_prefill is not None
    assert s.plan.placement.is_hybrid == (name == "fp16_hybrid")
    ps = prompts(s.spec.vocab_size, 4)                        # 3, 9, 1, 17 tokens: the 1-token one decodes
    singles = single_runs(s, ps, 1)
    m = BatchModel(s, 4)
    assert m.streamed is not None, "expected the loan beside the slots' pages (or in the hybrid ring)"
    assert m.loan_in_ring == (name == "fp16_hybrid"), "a hybrid ring of two blocks holds the prompts' loan"
    before = m.streamed.bytes_streamed
    rows = m.prefill_many([(b, p) for b, p in enumerate(ps)])
    block_bytes = sum(a.nbytes for a in m.streamed.arenas)
    assert m.streamed.bytes_streamed - before == block_bytes, "expected one crossing of the CPU block for all"
    for b, (want, got) in enumerate(zip(singles, rows)):
        diff = float(np.abs(got - want[0]).max())
        print(f"prompt {b} ({len(ps[b])} tokens): max |joint - single| = {diff:.3e}")
        assert np.array_equal(got.view(np.uint32), want[0].view(np.uint32)), (b, diff)
    for b in range(len(ps)):
        m.free(b)
    assert m.pages_in_use() == 0
