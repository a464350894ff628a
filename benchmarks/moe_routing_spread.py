"""How a mixture of experts' tokens spread over its experts: a prompt of seeded random token ids prefilled through a
loaded bundle, each routed block's selections counted where the runtime routes them (runtime/moe_routing's
RoutingCounter) and its router's softmax read beside them.

    python -m benchmarks.moe_routing_spread BUNDLE [--weights FILE.gguf] [--tokens 256] [--seed 0] [--hot 16] \
        [--json OUT]

Per block: the distinct experts selected, the share of all selections the `--hot` most selected experts took, and
over the tokens the mean softmax probability of the k selected experts together (before renormalising) and of the
first. A trained router spreads a prompt over nearly all its experts; random blocks of quants under positive
scales send nearly every token to the same few (their rows' large common mean makes every hidden state alike),
which flatters an expert cache's hit rate and a prompt's time. Runs wherever the bundle loads (a CPU-only bundle
routes every block on the host).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class BlockRouting:
    layer: int
    tokens: int
    distinct: int             # experts selected at least once
    hottest_share: float      # the share of the selections taken by the `hot` most selected experts
    topk_mass: float          # mean over the tokens of the k selected experts' softmax probability, summed
    top1_prob: float          # mean over the tokens of the largest softmax probability


def block_routing(layer: int, counts: np.ndarray, logits: np.ndarray, k: int, hot: int) -> BlockRouting:
    """counts [E]: selections per expert; logits [S, E]: the router's, for the same S tokens."""
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    top = -np.sort(-p, axis=-1)
    return BlockRouting(layer, int(logits.shape[0]), int((counts > 0).sum()),
                        float(np.sort(counts)[::-1][:hot].sum() / counts.sum()),
                        float(top[:, :k].sum(axis=-1).mean()), float(top[:, 0].mean()))


def measure_spread(session, ids: list[int], hot: int = 16) -> list[BlockRouting]:
    """Each routed block's BlockRouting over `ids`, prefilled once from position 0 (the session reset after)."""
    from helmc.errors import HelmcError
    from helmc.runtime.moe_expert_rate import host_feed_forwards
    from helmc.runtime.moe_routing import RoutingCounter
    spec = session.spec
    if spec.moe is None:
        raise HelmcError("routing spread: expected a mixture-of-experts bundle, found a dense one")
    ffns = host_feed_forwards(session)
    if not ffns:
        raise HelmcError("routing spread: expected the session to route experts on the host, found no router")
    counter = RoutingCounter(spec.num_layers, spec.moe.num_experts, spec.moe.top_k)
    logits: dict[int, list[np.ndarray]] = {}

    def observed(ffn):
        routed_sum = ffn.routed_sum

        def routed_sum_seen(phase, m, lg, experts):
            logits.setdefault(experts.layer, []).append(np.array(lg, dtype=np.float32))
            return routed_sum(phase, m, lg, experts)
        return routed_sum_seen

    session.reset()
    for f in ffns:
        f.routing, f.routed_sum = counter, observed(f)
    try:
        session.forward(list(ids))
    finally:
        for f in ffns:
            f.routing = None
            del f.routed_sum                 # the class's method again
        session.reset()
    return [block_routing(i, counter.counts[i], np.concatenate(logits[i]), spec.moe.top_k, hot)
            for i in sorted(logits)]


def random_prompt(vocab: int, tokens: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, tokens).tolist()


def summary(blocks: list[BlockRouting], experts: int, hot: int) -> str:
    d = [b.distinct for b in blocks]
    return (f"{len(blocks)} blocks, {blocks[0].tokens} tokens: distinct experts a block {min(d)}-{max(d)} of {experts} "
            f"(mean {np.mean(d):.1f}); hottest {hot} took {np.mean([b.hottest_share for b in blocks]):.3f} of the "
            f"selections; top-k softmax mass {np.mean([b.topk_mass for b in blocks]):.3f}, top-1 "
            f"{np.mean([b.top1_prob for b in blocks]):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--weights", default=None, help="the model file, where the bundle does not hold its path")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hot", type=int, default=16, help="the hottest experts whose share is reported")
    ap.add_argument("--json", default=None, help="write the per-block figures here")
    a = ap.parse_args(argv)
    from helmc.errors import HelmcError
    from helmc.runtime.session import Session
    for name in ("tokens", "hot"):
        if getattr(a, name) < 1:
            print(f"moe_routing_spread: --{name} expected a positive count, found {getattr(a, name)}", file=sys.stderr)
            return 2
    try:
        s = Session.load(a.bundle, a.weights, quiet=True)
        blocks = measure_spread(s, random_prompt(s.spec.vocab_size, a.tokens, a.seed), a.hot)
    except HelmcError as e:
        print(f"moe_routing_spread: {e}", file=sys.stderr)
        return 2
    for b in blocks:
        print(f"block {b.layer:3d}: {b.distinct:4d} experts, hottest {a.hot} {b.hottest_share:.3f}, "
              f"top-k mass {b.topk_mass:.3f}, top-1 {b.top1_prob:.3f}")
    print(summary(blocks, s.spec.moe.num_experts, a.hot))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bundle": a.bundle, "tokens": a.tokens, "seed": a.seed, "hot": a.hot,
                       "blocks": [asdict(b) for b in blocks]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
