"""The plain CPU/GPU split the device tests' bundles are built with: the search's plan for 128-token prompts (no
hybrid decode) at a fixed CPU unit count, with no other candidate, group, streamed prefill or staging, so a test
knows what runs where; and the builders' command line."""
from __future__ import annotations

import argparse
import os


def forced_split(spec, hw, cpu_units: int, batch: int):
    """search_plan's plan for `spec` on `hw` made the split at `cpu_units` (0: every block and the head on the GPU)
    with batched decode variants for `batch` sequences; a prompt runs whole (prefill_chunk_tokens 0)."""
    from helmc.compiler.pipeline import search_plan
    plan = search_plan(spec, hw, 128, 128, batch=batch, hybrid=False)
    return plan.replace(cpu_units=cpu_units, candidates=(), groups=(), hybrid_candidates=(), prefill_on_gpu=False,
                        prefill_staging_bytes=0, prefill_chunk_tokens=0, staging_ring_bytes=0, t_copy_ms=0.0)


def main(doc: str, bundles: dict, build) -> None:
    """A builder's command line: OUT, --hardware (the H200 preset by default), --only NAME ...; calls
    build(out, hardware, only)."""
    from helmc.hardware.profile import PRESET_DIR
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hardware", default=os.path.join(PRESET_DIR, "h200-profiled.json"))
    ap.add_argument("--only", nargs="*", default=(), choices=sorted(bundles), help="build only these bundles")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    build(a.out, a.hardware, tuple(a.only))
