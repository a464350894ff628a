"""A bundle's Session against Hugging Face references stored by a builder (refs.npz: the prompt, transformers' last
prompt logits and its greedy tokens), shared by the prefill and AMX tests that run on the GPU machine
(tests/runtime/test_prefill_gpu.py, tests/runtime/test_amx_prefill.py). Imports only the runtime and NumPy.
"""
from __future__ import annotations

import numpy as np


def tokens_agree(ours: list[int], ref: list[int], top5_at) -> tuple[bool, int]:
    """(agree, first divergence): identical tokens, or at the first divergence HF's token is in helmc's top 5
    there (top5_at(i): helmc's top-5 ids after its first i tokens)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return bool(b in top5_at(i)), i
    return True, len(ref)


def compare_with_hf(session, prompt: list[int], ref_logits, ref_greedy: list[int], new_tokens: int):
    """One bundle's session against HF's references: (its last prompt logits, their max|diff| / max|ref|, its
    greedy generation (GenerateResult), tokens_agree's (agree, first divergence))."""
    session.reset()
    logits = session.forward(prompt)[-1]
    rel = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
    result = session.generate(prompt_ids=prompt, max_new_tokens=new_tokens, stop_at_eos=False)

    def top5_at(i):
        session.reset()
        return set(np.argsort(session.forward(prompt + result.tokens[:i])[-1])[-5:].tolist())

    agree, first = tokens_agree(result.tokens, ref_greedy, top5_at)
    return logits, rel, result, bool(agree), first
