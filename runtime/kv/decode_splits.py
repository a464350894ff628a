"""How a decode step's attention is cut into splits over the pages of a sequence, and which host pages are staged when.

Pure bookkeeping over page counts (no device memory): KVCacheGPU caches the result per page layout.
"""
from __future__ import annotations


def plan_splits(n_pages: int, T: int, num_sms: int, h_kv: int, staging_pages: int, on_device):
    """(tokens per split, splits, which splits read a host page, the staging chunks, each host page's staging slot).

    Splits are p whole pages, or at short contexts (fewer pages than ~4 blocks per SM need) 1/c of a page (c a
    power of two, >= 32 tokens), so a short sequence still spreads over the SMs. Both depend on the page count
    alone: offload never changes a split. on_device(i): whether page i is resident (else staged from the host).
    A chunk stages at most half the staging pages, and every split reading one of them: whole pages per chunk.
    """
    target = max(1, 4 * num_sms // h_kv)
    p = max(1, min(-(-n_pages // target), staging_pages // 2))
    cut = 1
    while p == 1 and 2 * cut * n_pages <= target and T % (2 * cut) == 0 and T // (2 * cut) >= 32:
        cut *= 2
    span = p * T // cut
    n_splits = -(-n_pages * cut // p)

    def pages_of(sp):
        return range(sp * span // T, min(n_pages, -(-(sp + 1) * span // T)))

    host_split = [any(not on_device(i) for i in pages_of(sp)) for sp in range(n_splits)]
    hosts = [sp for sp in range(n_splits) if host_split[sp]]
    half = staging_pages // 2
    host_pages = sorted({i for sp in hosts for i in pages_of(sp) if not on_device(i)})
    chunks, stage_of = [], {}
    groups = ([host_pages[c0:c0 + half] for c0 in range(0, len(host_pages), half)] if cut > 1 else
              [[i for sp in hosts[c0:c0 + max(1, half // p)] for i in pages_of(sp) if not on_device(i)]
               for c0 in range(0, len(hosts), max(1, half // p))])
    for c, pages in enumerate(groups):
        splits = [sp for sp in hosts if any(i in pages for i in pages_of(sp))]
        for j, i in enumerate(pages):
            stage_of[i] = (c % 2) * half + j
        chunks.append((splits, pages))
    return span, n_splits, host_split, chunks, stage_of


# Up to this many tokens of pages, decode attention runs paged_decode_short (one block per query head, no split
# partials; schedules/gpu/paged_decode_short.py): measured at 5.2 us a layer against the split kernel's
# 9.9 (11.7 before its loads were straightened) at 190 tokens of Qwen3-8B on an H200, 14.7 against 16.8 at 1000,
# even at 2000.
SHORT_MAX_TOKENS = 1024


def short_path(n_pages: int, T: int, staging_pages: int) -> bool:
    """Whether a decode step over n_pages pages of T tokens runs the short kernel: a function of the page count
    alone, like the splits, so offload never changes which kernel (and so which bits) a step gets; the pages fit
    half the staging slots, so a step with some of them on the host stages them all in one chunk."""
    return n_pages * T <= SHORT_MAX_TOKENS and n_pages <= staging_pages // 2


def runs(splits) -> list[tuple[int, int]]:
    """Consecutive integers -> [(start, end)) ranges."""
    out: list[list[int]] = []
    for sp in splits:
        if out and out[-1][1] == sp:
            out[-1][1] += 1
        else:
            out.append([sp, sp + 1])
    return [tuple(r) for r in out]
