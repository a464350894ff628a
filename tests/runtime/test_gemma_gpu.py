"""Gemma 3's blocks on the GPU stage end to end on the GPU machine against Hugging Face: a tiny Gemma 3 (head_dim 256,
sliding blocks of window 8 with their own RoPE table beside global ones, (1 + w) and sandwich norms, GeGLU,
query_pre_attn_scalar) with every block on the GPU (`all_gpu`), split 3 / 3 with the CPU (`split`), blocks 0-2 on the
host with their prefill streamed to the GPU (`streamed`), and hybrid decode C0 [0] S0 [1, 2] C1 [3] S1 [4] | resident [5]
(`hybrid`: a sliding and a global block streamed each token), prefilling in chunks of 16 tokens, decoding 24 tokens
past five windows.

The bundles and references are built on the compiler machine by
    python -m tests.device.build_gemma_gpu_bundles .devrt/gemma3_gpu
and carried to the GPU machine; the test looks in $HELMC_GEMMA_GPU_DIR (default .devrt/gemma3_gpu). Pass: the
prompt's last logits within 2e-2 of transformers' fp32 (max |diff| / max |ref|: fp16 activations on the GPU), the
greedy tokens identical or, at the first divergence, transformers' token in helmc's top 5; the GPU cache's layers
carry the blocks' own windows (a hybrid plan's streamed blocks first), the streamed prefill and the hybrid ring move
the host blocks' weights, and the decode steps (the streamed groups' too) replay CUDA graphs. Imports no compiler: it runs with the runtime-only TVM (TVM_USE_RUNTIME_LIB=1).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gpu_prebuilt import prebuilt_dir

pytestmark = pytest.mark.gpu

LOGIT_TOLERANCE = 2e-2          # fp16 activations on the GPU against an fp32 reference
NEW_TOKENS = 24


def gemma_dir() -> str:
    return prebuilt_dir("HELMC_GEMMA_GPU_DIR", "gemma3_gpu", "refs.npz", "Gemma 3 GPU bundles",
                        "build_gemma_gpu_bundles .devrt/gemma3_gpu")


@pytest.mark.parametrize("name,gpu_windows", [("all_gpu", (8, 8, 0, 8, 8, 0)), ("split", (0, 8, 8, 0)),
                                               ("streamed", (8, 8, 0)), ("hybrid", (8, 0, 8, 0))])
def test_gemma3_gpu_stage_matches_transformers(name, gpu_windows):
    from helmc.runtime.session import Session
    from tests.hf_checks import compare_with_hf
    d = gemma_dir()
    refs = np.load(os.path.join(d, "refs.npz"))
    prompt, ref_greedy = refs["prompt"].tolist(), refs["greedy"].tolist()
    s = Session.load(os.path.join(d, name))
    assert s.gpu.stage.kv.windows == gpu_windows
    _, rel, r, agree, first = compare_with_hf(s, prompt, refs["logits"], ref_greedy, NEW_TOKENS)
    print(f"\ngemma3 {name}: logits max|diff|/max|ref| {rel:.2e}; greedy identical to HF for {first}/"
          f"{len(ref_greedy)}; TTFT {r.ttft_ms:.1f} ms, decode {r.decode_tok_s:.0f} tok/s")
    graph = s.gpu.decode_graph
    if graph is not None:        # sliding windows replay too: a graph per first split of each window
        print(f"decode graph: {graph.captures} captures, {graph.replays} replays, {graph.eager_steps} eager steps")
        assert not graph.disabled and graph.replays > 0, (graph.disabled, graph.replays)
    if s.gpu.streamed_prefill is not None:       # streamed and hybrid: the host blocks' prefill ran on the GPU
        assert s.gpu.streamed_prefill.bytes_streamed > 0
    if s.gpu.hybrid is not None:
        backend = s.gpu.hybrid.backend
        print(f"hybrid: {s.gpu.hybrid.schedule.describe()}; {backend.bytes_copied / 2**20:.1f} MiB through the ring")
        assert s.gpu.hybrid.tokens > 0 and backend.bytes_copied > 0
        groups = backend.graphs or []            # each streamed group's own graph, replayed per token
        assert groups and all(g.replays > 0 and not g.disabled for g in groups), [(g.replays, g.disabled) for g in groups]
    assert rel <= LOGIT_TOLERANCE, (name, rel)
    assert agree, f"{name}: HF's token {ref_greedy[first]} not in helmc's top 5 at its first divergence ({first})"
