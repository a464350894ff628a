"""ExpertStats: how often a mixture of experts' router selects each routed expert of each block, measured by running
the model over a calibration prompt (runtime/moe_routing.py), stored in a bundle as `expert_stats.json`.

The planner puts each block's most often selected experts in VRAM and predicts the share of selections they take
(the hit rate) from these counts (helmc/planner/moe.py); without them routing is taken as uniform.

The file is a bundle file like any other: listed in the manifest with its sha256, so it is verified before it is read.
`store_expert_stats` adds it to (or replaces it in) an unsigned bundle and rewrites the manifest; a signed bundle's
manifest is never rewritten (its signature would no longer match).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.jsonio import from_dict, parse_json, to_dict

EXPERT_STATS_FILE = "expert_stats.json"
EXPERT_STATS_FORMAT_VERSION = 1
_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class ExpertStats:
    format_version: int
    num_experts: int
    top_k: int
    tokens: int                                # tokens routed through every routed block
    counts: tuple[tuple[int, ...], ...]        # per block (index = block): selections per expert; () for a dense block
    source: str = ""                           # what measured them: "build" | "calibrate"
    prompt: str = ""                           # the calibration prompt's name
    # the counts of the prompt's first first_half_tokens tokens alone (the rest's: counts - first_half), so the hit
    # rate of experts chosen by counts is predicted on tokens that did not choose them; () where not measured
    first_half: tuple[tuple[int, ...], ...] = ()
    first_half_tokens: int = 0

    def __post_init__(self):
        if self.format_version != EXPERT_STATS_FORMAT_VERSION:
            raise HelmcError(f"expert stats: format_version expected {EXPERT_STATS_FORMAT_VERSION}, found "
                             f"{self.format_version}")
        if not (self.num_experts >= 1 and 1 <= self.top_k <= self.num_experts and self.tokens >= 1):
            raise HelmcError(f"expert stats: expected num_experts >= 1, 1 <= top_k <= num_experts and tokens >= 1, "
                             f"found {self.num_experts}, {self.top_k}, {self.tokens}")
        if not any(self.counts):
            raise HelmcError("expert stats: expected counts for at least one routed block, found none")
        for i, row in enumerate(self.counts):
            if not row:
                continue
            if len(row) != self.num_experts:
                raise HelmcError(f"expert stats: block {i} expected {self.num_experts} counts, found {len(row)}")
            if min(row) < 0 or sum(row) != self.tokens * self.top_k:
                raise HelmcError(f"expert stats: block {i} expected non-negative counts summing to tokens x top_k = "
                                 f"{self.tokens * self.top_k}, found sum {sum(row)}, least {min(row)}")

        if self.first_half:
            self._check_first_half()

    def _check_first_half(self) -> None:
        if not (0 < self.first_half_tokens < self.tokens and len(self.first_half) == len(self.counts)):
            raise HelmcError(f"expert stats: expected first-half counts of 0 < first_half_tokens < {self.tokens} "
                             f"tokens over {len(self.counts)} blocks, found {self.first_half_tokens} tokens over "
                             f"{len(self.first_half)} blocks")
        for i, (row, half) in enumerate(zip(self.counts, self.first_half)):
            if len(half) != len(row) or any(h < 0 or h > c for h, c in zip(half, row)) or (
                    row and sum(half) != self.first_half_tokens * self.top_k):
                raise HelmcError(f"expert stats: block {i} expected first-half counts between 0 and the block's "
                                 f"counts summing to {self.first_half_tokens * self.top_k}, found sum {sum(half)}")

    def routed(self, layer: int) -> bool:
        return layer < len(self.counts) and bool(self.counts[layer])

    def hottest(self, layer: int, n: int) -> tuple[int, ...]:
        """Block `layer`'s n most often selected experts, sorted by id (ties to the lower id)."""
        row = self.counts[layer]
        order = sorted(range(self.num_experts), key=lambda e: (-row[e], e))
        return tuple(sorted(order[:n]))

    def mass(self, layer: int, experts) -> float:
        """The share of block `layer`'s selections that went to `experts`."""
        row = self.counts[layer]
        return sum(row[e] for e in set(experts)) / (self.tokens * self.top_k)

    def predicted_mass(self, layer: int, n: int) -> float:
        """The share of block `layer`'s selections its n hottest experts (by the counts) would take on other tokens:
        with the halves measured, the mean of each half's n hottest experts' share of the other half's selections
        (experts chosen on a sample take more of that sample than of new tokens: on spread routing 0.26 in sample
        against 0.08 in decode); else their share of the counts themselves."""
        if not self.first_half:
            return self.mass(layer, self.hottest(layer, n))
        a = self.first_half[layer]
        b = tuple(c - h for c, h in zip(self.counts[layer], a))

        def top(row):
            return sorted(range(self.num_experts), key=lambda e: (-row[e], e))[:n]

        return (sum(b[e] for e in top(a)) / sum(b) + sum(a[e] for e in top(b)) / sum(a)) / 2

    def check_for(self, spec) -> None:
        """These counts against a model spec: its expert layout and routed blocks."""
        moe = spec.moe
        if moe is None:
            raise HelmcError("expert stats: expected a mixture-of-experts model, found a dense one")
        routed = tuple(i for i in range(spec.num_layers) if spec.is_moe_layer(i))
        found = tuple(i for i in range(len(self.counts)) if self.counts[i])
        if (self.num_experts, self.top_k, len(self.counts), found) != (moe.num_experts, moe.top_k, spec.num_layers,
                                                                         routed):
            raise HelmcError(f"expert stats: expected {moe.num_experts} experts, top-{moe.top_k}, {spec.num_layers} "
                             f"blocks routed at {list(routed)[:8]}, found {self.num_experts}, top-{self.top_k}, "
                             f"{len(self.counts)} blocks routed at {list(found)[:8]}")

    def to_json(self) -> str:
        return json.dumps(to_dict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ExpertStats":
        return from_dict(cls, parse_json(text, "expert stats"), "expert stats")


def read_expert_stats(bundle_dir: str, manifest) -> ExpertStats | None:
    """The bundle's routing statistics, or None where it has none. `manifest`: the verified manifest (the file's
    digest was checked with it)."""
    if not manifest.lists(EXPERT_STATS_FILE):
        return None
    from helmc.jsonio import read_regular_file
    data = read_regular_file(os.path.join(bundle_dir, EXPERT_STATS_FILE), "expert stats", limit=_MAX_BYTES)
    try:
        return ExpertStats.from_json(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise HelmcError(f"expert stats: expected UTF-8 JSON in {bundle_dir}/{EXPERT_STATS_FILE}, found other "
                         "bytes") from None


def store_expert_stats(bundle_dir: str, stats: ExpertStats, plan=None) -> str:
    """Write `stats` (and `plan`, a Plan made from them, as plan.json where given) into the (verified) bundle and
    list them in its manifest; returns the path written. A signed bundle is refused in one line: rewriting its
    manifest would void the signature."""
    from helmc.jsonio import atomic_write_text
    from helmc.runtime.bundle.manifest import MANIFEST_NAME, BundleFile, BundleManifest, sha256_file
    from helmc.runtime.bundle.signature import SIGNATURE_NAME
    if os.path.exists(os.path.join(bundle_dir, SIGNATURE_NAME)):
        raise HelmcError(f"expert stats: expected an unsigned bundle to add {EXPERT_STATS_FILE} to, found "
                         f"{bundle_dir} signed (rebuild and sign it again to keep the statistics)")
    texts = {EXPERT_STATS_FILE: stats.to_json()}
    if plan is not None:
        texts["plan.json"] = plan.to_json()
    with open(os.path.join(bundle_dir, MANIFEST_NAME), encoding="utf-8") as f:
        manifest = BundleManifest.from_json(f.read())
    entries = []
    for name, text in texts.items():
        full = os.path.join(bundle_dir, name)
        atomic_write_text(full, text + "\n")
        entries.append(BundleFile(name, sha256_file(full), os.path.getsize(full)))
    files = tuple(sorted([f for f in manifest.files if f.path not in texts] + entries, key=lambda f: f.path))
    import dataclasses
    atomic_write_text(os.path.join(bundle_dir, MANIFEST_NAME),
                      dataclasses.replace(manifest, files=files).to_json() + "\n")
    return os.path.join(bundle_dir, EXPERT_STATS_FILE)
