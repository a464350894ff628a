"""Batched decode against single-request decode on one Session, shared by the CPU test
(tests/runtime/test_batch_decode_cpu.py) and the GPU one (tests/runtime/test_batch_decode_gpu.py).

single_runs: each prompt alone, greedy, through Session.forward (the path of `helmc run`; on a GPU stage the
captured decode graph). batched_runs: the same prompts through BatchModel, joining a running batch as the serve
engine admits them (prefilled while the others are mid-decode), so steps of 1 to B sequences occur and the
batched decode variants run on padded rows. Each sequence's logits must equal its single run's, every bit.
Imports only the runtime (NumPy, TVM runtime; CuPy through the session on a GPU).
"""
from __future__ import annotations

import numpy as np

PROMPT_LENGTHS = (3, 9, 1, 17, 5, 30, 2, 11)


def prompts(vocab: int, count: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, size=n)] for n in PROMPT_LENGTHS[:count]]


def single_runs(session, prompt_list: list[list[int]], steps: int) -> list[np.ndarray]:
    """[steps, V] logits per prompt: its prompt's last row, then each greedy token's decode step."""
    out = []
    for p in prompt_list:
        session.reset()
        rows = [session.forward(p)[-1]]
        for _ in range(steps - 1):
            rows.append(session.forward([int(np.argmax(rows[-1]))])[-1])
        out.append(np.stack(rows))
    session.reset()
    return out


def batched_runs(session, prompt_list: list[list[int]], steps: int, max_batch: int, stagger: int = 2):
    """([steps, V] logits per prompt, batch sizes of the decode steps taken): sequence b joins at step
    b // stagger into the lowest free slot (at most max_batch at once), leaves after `steps` logits."""
    from helmc.runtime.serve.batch_model import BatchModel
    m = BatchModel(session, max_batch)
    logits = {b: [] for b in range(len(prompt_list))}
    slot_of, sizes, t = {}, [], 0
    while any(len(v) < steps for v in logits.values()):
        for b in range(len(prompt_list)):       # finished sequences give their slot back
            if b in slot_of and len(logits[b]) >= steps:
                m.free(slot_of.pop(b))
        running = [b for b in slot_of]
        new = [b for b in range(len(prompt_list)) if b // stagger <= t and not logits[b] and b not in slot_of]
        for b in new[:max_batch - len(running)]:
            slot_of[b] = min(set(range(max_batch)) - set(slot_of.values()))
            logits[b].append(m.prefill(slot_of[b], prompt_list[b]))
        if running:
            rows = m.decode([slot_of[b] for b in running], [int(np.argmax(logits[b][-1])) for b in running])
            sizes.append(len(running))
            for b, row in zip(running, rows):
                logits[b].append(row)
        t += 1
    for slot in list(slot_of.values()):
        m.free(slot)
    assert m.pages_in_use() == 0
    return [np.stack(logits[b]) for b in range(len(prompt_list))], sizes


def compare(singles: list[np.ndarray], batched: list[np.ndarray], label: str) -> None:
    """Every sequence's logits bit-identical to its single run's, so its greedy tokens are too."""
    for b, (want, got) in enumerate(zip(singles, batched)):
        assert got.shape == want.shape, (label, b, got.shape, want.shape)
        same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
        if not same:
            step = int(np.argmax(np.any(got != want, axis=1)))
            diff = float(np.abs(got - want).max() / np.abs(want).max())
            raise AssertionError(f"{label}: sequence {b}'s logits differ from its single run first at step {step} "
                                 f"(max rel diff {diff:.2e}); greedy tokens "
                                 f"{'equal' if list(got.argmax(1)) == list(want.argmax(1)) else 'differ'}")
        assert list(got.argmax(1)) == list(want.argmax(1))
