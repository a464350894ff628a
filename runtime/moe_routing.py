"""Routing statistics of a mixture of experts, measured by running the model: a calibration prompt prefilled through a
loaded Session, every routed block's top-k selections counted where the runtime routes them (moe_experts.route, on
the host, for the CPU stage's blocks and the GPU stage's alike). The counts become an ExpertStats
(bundle/expert_stats.py), from which the planner keeps each block's most often selected experts in VRAM.

A prompt, not decode steps: a prompt's rows are all routed on the host (a decode row of a block with every expert in
VRAM is routed on the GPU, unseen here), and its tokens are what the calibration text is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.bundle.expert_stats import EXPERT_STATS_FORMAT_VERSION, ExpertStats
from helmc.runtime.moe_expert_rate import host_feed_forwards

# The calibration prompt: ordinary prose on varied subjects, so a trained router spreads over the experts it uses on
# text (random weights route as they do on any tokens).
CALIBRATION_NAME = "helmc-prose-1"
CALIBRATION_TEXT = (
    "The history of the river towns is written in their bridges. Each generation built a crossing with what it had: "
    "timber in the early years, then stone quarried from the hills to the north, and finally steel carried in by the "
    "railway. When the floods of the spring came, the old wooden bridges were the first to go, and the ferrymen who "
    "had lost their trade to them found it again for a season.\n\n"
    "To compute the area of a circle, square its radius and multiply by pi. A circle of radius 3 has an area of "
    "about 28.27 square units; doubling the radius multiplies the area by four. def area(r):\n    return 3.14159 * r "
    "* r\n\nprint([area(r) for r in range(1, 5)])\n\n"
    "Bread rises because yeast eats the sugars in the flour and releases carbon dioxide, which the gluten holds in "
    "small pockets. A cold, slow rise gives a deeper flavour; a warm, fast one a lighter loaf. Salt slows the yeast, "
    "so bakers add it after the dough has rested.\n\n"
    "Q: What is the capital of Australia? A: Canberra, chosen in 1908 as a compromise between Sydney and Melbourne. "
    "Q: How many bones are in the adult human body? A: Two hundred and six.\n\n"
    "Dear committee, I am writing to ask for an extension of the deadline for the final report. The field data from "
    "the second survey arrived late, and the analysis of the soil samples will take another three weeks. I attach a "
    "revised schedule and remain available for any questions. Yours sincerely, the project team.\n\n"
    "Las montañas del norte se cubren de nieve en invierno, y los pueblos del valle viven del turismo. "
    "Der Zug nach Berlin fährt um acht Uhr ab. 春天来了，花开了。\n")


class RoutingCounter:
    """Per block, how many times each expert was selected, and how many rows were routed."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, first_half_rows: int = 0):
        self.counts = np.zeros((num_layers, num_experts), np.int64)
        self.first = np.zeros((num_layers, num_experts), np.int64)      # the first first_half_rows rows' counts
        self.rows = np.zeros(num_layers, np.int64)
        self.top_k = top_k
        self.first_half_rows = first_half_rows

    def record(self, layer: int, idx: np.ndarray) -> None:
        """idx [S, k]: the experts route() selected for the next S rows of block `layer` (the prompt's rows arrive
        in order, chunk by chunk)."""
        if not 0 <= layer < len(self.rows):
            raise HelmcError(f"routing statistics: expected a block index in [0, {len(self.rows)}), found {layer}")
        idx = np.asarray(idx)
        early = max(0, min(idx.shape[0], self.first_half_rows - int(self.rows[layer])))   # rows still in the first half
        np.add.at(self.counts[layer], idx.reshape(-1), 1)
        np.add.at(self.first[layer], idx[:early].reshape(-1), 1)
        self.rows[layer] += idx.shape[0]

    def stats(self, spec, source: str, prompt: str) -> ExpertStats:
        routed = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
        tokens = {int(self.rows[i]) for i in routed}
        if len(tokens) != 1 or 0 in tokens:
            raise HelmcError(f"routing statistics: expected every routed block to route the same tokens, found "
                             f"{sorted(tokens)[:4]} rows")
        counts = tuple(tuple(int(c) for c in self.counts[i]) if i in routed else () for i in range(spec.num_layers))
        n = tokens.pop()
        halves = {}
        if 0 < self.first_half_rows < n:
            halves = {"first_half": tuple(tuple(int(c) for c in self.first[i]) if i in routed else ()
                                          for i in range(spec.num_layers)), "first_half_tokens": self.first_half_rows}
        return ExpertStats(EXPERT_STATS_FORMAT_VERSION, spec.moe.num_experts, spec.moe.top_k, n, counts,
                           source, prompt, **halves)


RANDOM_IDS_NAME = "random-ids"    # a bundle without a tokenizer: seeded random token ids stand for the text


def calibration_ids(session, max_tokens: int = 512) -> tuple[list[int], str]:
    """(the calibration prompt's ids, its name): the calibration text in the session's tokenizer, or without one
    max_tokens seeded random ids; at most `max_tokens` and what the plan's context allows."""
    n = min(max_tokens, session.plan.memory.max_context)
    if session.tokenizer is None:
        rng = np.random.default_rng(0)
        return rng.integers(0, session.spec.vocab_size, n).tolist(), RANDOM_IDS_NAME
    return session.tokenizer.encode(CALIBRATION_TEXT).ids[:n], CALIBRATION_NAME


def measure_routing(session, ids: list[int] | None = None, source: str = "calibrate",
                    prompt: str = "") -> ExpertStats:
    """ExpertStats of `session`'s model over a prompt (the calibration text unless `ids` are given), prefilled once
    from position 0; the session is reset after."""
    spec = session.spec
    if spec.moe is None:
        raise HelmcError("routing statistics: expected a mixture-of-experts model, found a dense one")
    if ids is None:
        ids, prompt = calibration_ids(session)
    ids = list(ids)
    if not ids:
        raise HelmcError("routing statistics: expected a prompt of at least one token, found none")
    counter = RoutingCounter(spec.num_layers, spec.moe.num_experts, spec.moe.top_k, first_half_rows=len(ids) // 2)
    ffns = host_feed_forwards(session)
    if not ffns:
        raise HelmcError("routing statistics: expected the session to route experts on the host, found no router")
    session.reset()
    for f in ffns:
        f.routing = counter
    try:
        session.forward(ids)
    finally:
        for f in ffns:
            f.routing = None
        session.reset()
    return counter.stats(spec, source, prompt)


@dataclass(frozen=True)
class RoutingCalibration:
    """What `helmc calibrate` measured of a mixture-of-experts bundle (calibrate_routing)."""
    lines: tuple[str, ...] = ()                          # what was done, a line each
    expert_sum_reads: tuple[tuple[str, int, float], ...] = ()   # (gate/up weight type, experts a call, GB/s)
    host_half_ms: float | None = None                    # a GPU stage's host half per routed block (None: none ran)


def calibrate_routing(bundle_dir: str, weights_dir: str | None = None, trusted_keys: tuple | None = None,
                      require_signed: bool = False, source: str = "calibrate") -> RoutingCalibration:
    """Measure a mixture-of-experts bundle's routing statistics on this machine and store them in the bundle
    (expert_stats.json, listed in its manifest, the bundle verified again after), its CPU one-call expert sum's
    read rates (moe_expert_rate.measure_expert_sum) and a GPU stage's host half at a routed decode block
    (moe_expert_rate.measure_host_half). A dense bundle is left alone; a signed one keeps its files (its signature
    would break), its rates are still measured."""
    import os

    from helmc.runtime.bundle.expert_stats import store_expert_stats
    from helmc.runtime.bundle.manifest import verify_bundle
    from helmc.runtime.bundle.signature import SIGNATURE_NAME
    from helmc.runtime.session import Session, read_bundle
    _, spec, _, _ = read_bundle(bundle_dir, weights_dir, trusted_keys, require_signed)
    from helmc.runtime.moe_expert_rate import measure_expert_sum, measure_host_half
    if spec.moe is None:
        return RoutingCalibration()
    session = Session.load(bundle_dir, weights_dir, quiet=True, trusted_keys=trusted_keys,
                           require_signed=require_signed)
    reads = measure_expert_sum(session)
    half = measure_host_half(session)
    lines = tuple(f"CPU one-call expert sum ({t}): {n} experts a call read at {gbs:.2f} GB/s" for t, n, gbs in reads)
    if half is not None:
        lines += (f"GPU stage's host half at a routed decode block (the CPU's expert sum apart): {half:.4f} ms",)
    if os.path.exists(os.path.join(bundle_dir, SIGNATURE_NAME)):
        return RoutingCalibration(lines + (f"routing statistics: not stored in {bundle_dir}, a signed bundle (rebuild "
                                           "and sign it to include them)",), reads, half)
    stats = measure_routing(session, source=source)
    del session                           # its weights and caches go before the bundle is verified again
    path = store_expert_stats(bundle_dir, stats)
    verify_bundle(bundle_dir, trusted_keys=trusted_keys, require_signed=require_signed)
    eighth = max(1, stats.num_experts // 8)
    routed = [i for i in range(len(stats.counts)) if stats.routed(i)]
    hot = sum(stats.mass(i, stats.hottest(i, eighth)) for i in routed) / len(routed)
    held_out = sum(stats.predicted_mass(i, eighth) for i in routed) / len(routed)
    return RoutingCalibration(lines + (
        f"routing statistics: {stats.tokens} tokens of {stats.prompt} routed, the hottest eighth of each block's "
        f"experts took {hot:.2f} of the selections ({held_out:.2f} of the other half's, chosen on one half of the "
        f"prompt); wrote {path}",), reads, half)
