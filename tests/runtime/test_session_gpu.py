"""Greedy generation through Session on the GPU with KV pages forced out to pinned host RAM.

A tiny watermark keeps one KV page of the GPU layers on the GPU: the prompt's older pages go
straight to pinned host memory and every decode step streams them back through staging. The tokens
must equal those of the same bundle with all KV on the GPU (kv_offload=False), and the pinned memory
the cache allocated must be what runtime/kv/capacity.py predicts for the request.

The bundle (a split cpu(2) -> cuda(4) tiny Qwen3) is built on the compiler machine by
    python -m tests.device.build_kv_session_bundle .devrt/kv_session
and carried to the GPU machine; the test looks in $HELMC_GPU_SESSION_BUNDLE, default
.devrt/kv_session/bundle. Nothing to regenerate: both runs happen here.
Imports no compiler: it runs with the runtime-only TVM (TVM_USE_RUNTIME_LIB=1).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_prebuilt import prebuilt_dir

pytestmark = pytest.mark.gpu

PAGE_TOKENS, NEW_TOKENS, PROMPT_TOKENS = 16, 40, 60


def gpu_bundle() -> str:
    return prebuilt_dir("HELMC_GPU_SESSION_BUNDLE", "kv_session/bundle", "manifest.json", "GPU test bundle",
                        "build_kv_session_bundle .devrt/kv_session")


def run(bundle: str, **kv_options):
    from helmc.runtime.session import Session
    s = Session.load(bundle, kv_page_tokens=PAGE_TOKENS, **kv_options)
    assert s.gpu is not None and s.gpu.stage is not None and s.cpu_stage is not None, "expected a CPU + GPU split"
    prompt = np.random.default_rng(0).integers(1, s.spec.vocab_size, PROMPT_TOKENS).tolist()
    r = s.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    return s, r


def test_forced_eviction_gives_the_same_tokens_as_no_offload():
    bundle = gpu_bundle()
    _, want = run(bundle, kv_offload=False)
    s, got = run(bundle, kv_watermark=1e-9, kv_offload=True)
    kv = s.gpu.stage.kv
    pages = -(-(PROMPT_TOKENS + NEW_TOKENS - 1) // PAGE_TOKENS)          # the last token is never fed back
    host_pages = kv.pool.host_capacity - kv.pool.host_free
    print(f"offload: {kv.resident_limit} GPU page(s) kept, {host_pages} of {pages} pages in pinned host RAM; "
          f"tokens {got.tokens[:12]}...")
    assert kv.resident_limit == 1
    assert host_pages == pages - 1, "every page but the newest went to the host"
    assert len(set(want.tokens)) > 1, "degenerate reference: the comparison would not catch a wrong page"
    assert got.tokens == want.tokens
    # the capacity check before the request predicted the pinned extents the cache then allocated
    pinned = len(kv._extents) * kv.extent_pages * kv.page_bytes
    assert s.kv_capacity.pinned_kv_bytes(PROMPT_TOKENS + NEW_TOKENS) == pinned > 0


def test_refuses_beyond_the_plan_before_any_work():
    from helmc.errors import HelmcError
    from helmc.runtime.session import Session
    bundle = gpu_bundle()
    s = Session.load(bundle, kv_page_tokens=PAGE_TOKENS)
    s.forward = None                            # generate must refuse before calling it
    with pytest.raises(HelmcError, match=f"do not fit; at most {s.plan.memory.max_context} fit: the plan allows"):
        s.generate(prompt_ids=[1] * s.plan.memory.max_context, max_new_tokens=1)
