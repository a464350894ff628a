"""Capacity planning for the KV cache: how many tokens fit before a request starts.

helmc refuses a request that cannot fit, with the numbers, instead of failing midway. Where KV lives:
  - CPU-stage layers: host RAM, every token.
  - GPU-stage layers with offload: the newest `watermark` share of the VRAM left after weights and
    workspace holds pages on the GPU; older pages go to pinned host RAM.
  - GPU-stage layers without offload (--no-kv-offload): every token in VRAM.
Everything is counted in whole pages, as the caches allocate them. Pure arithmetic, no devices.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from helmc.errors import HelmcError
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK

GIB = 1024 ** 3
HOST_RAM, VRAM, MODEL_WINDOW = "host RAM", "VRAM", "the model's context window"
PLAN_LIMIT = "the plan's context limit"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token over `num_layers` layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def gpu_resident_pages(slots_fit: int, watermark: float, pages_needed: int) -> int:
    """Pages the GPU cache keeps resident: the watermark share of the slots that fit, leaving at least
    one slot of headroom for the page being written while an old one is copied out. Mirrors
    KVCacheGPU's choice; 0 when not even one page fits."""
    if slots_fit < 1:
        return 0
    resident = min(slots_fit, max(1, int(watermark * slots_fit)))
    if resident >= pages_needed:
        return pages_needed                   # everything fits: nothing is ever evicted
    if resident == slots_fit:
        resident = slots_fit - 1              # eviction needs a spare slot
    return resident


@dataclass(frozen=True)
class KVCapacity:
    tokens_fit: int                 # longest context (prompt + new tokens) whose KV fits
    limited_by: str                 # HOST_RAM | VRAM | MODEL_WINDOW | PLAN_LIMIT
    page_tokens: int
    cpu_bytes_per_token: int        # KV of the CPU-stage layers (host RAM)
    gpu_bytes_per_token: int        # KV of the GPU-stage layers (VRAM, overflow in pinned host RAM)
    gpu_resident_pages: int         # pages of GPU-layer KV kept on the GPU
    host_bytes_free: int
    vram_bytes_free: int            # after weights and workspace
    offload: bool
    model_max_tokens: int
    host_extent_pages: int = 1      # pinned host pages are allocated this many at a time
    plan_max_tokens: int = 0        # the caches were sized for this many tokens (0: no such cap)

    @property
    def gpu_resident_tokens(self) -> int:
        return self.gpu_resident_pages * self.page_tokens

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def host_spill_pages(self, tokens: int) -> int:
        """Pinned host pages the GPU-layer KV of `tokens` tokens holds, in whole extents."""
        if not self.offload or not self.gpu_bytes_per_token:
            return 0
        spill = max(0, self.pages(tokens) - self.gpu_resident_pages)
        return -(-spill // self.host_extent_pages) * self.host_extent_pages

    def cpu_kv_bytes(self, tokens: int) -> int:
        return self.pages(tokens) * self.cpu_bytes_per_token * self.page_tokens

    def pinned_kv_bytes(self, tokens: int) -> int:
        return self.host_spill_pages(tokens) * self.gpu_bytes_per_token * self.page_tokens

    def host_bytes_needed(self, tokens: int) -> int:
        return self.cpu_kv_bytes(tokens) + self.pinned_kv_bytes(tokens)

    def vram_bytes_needed(self, tokens: int) -> int:
        n = self.pages(tokens)
        if self.offload:
            n = min(n, self.gpu_resident_pages)
        return n * self.gpu_bytes_per_token * self.page_tokens

    def fits(self, tokens: int) -> bool:
        return tokens <= self.tokens_fit


def _most_pages(fits, hi: int) -> int:
    """The largest n in [0, hi] with fits(n), for fits monotone (true, then false)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_kv_capacity(cpu_bytes_per_token: int, gpu_bytes_per_token: int, host_free_bytes: int,
                     vram_free_bytes: int, watermark: float = KV_WATERMARK, offload: bool = True,
                     page_tokens: int = KV_PAGE_TOKENS, model_max_tokens: int = 0, *, resident_pages: int | None = None,
                     host_extent_pages: int = 1, plan_max_tokens: int = 0) -> KVCapacity:
    """The most tokens whose KV fits, and which memory runs out first.

    vram_free_bytes: VRAM for GPU-layer KV pages (after weights and workspace; for an existing cache,
    its page pool); host_free_bytes: host RAM helmc may use for KV; model_max_tokens: the model's
    native window (0: no limit); resident_pages: an existing cache's watermark in pages (default:
    `watermark` of the slots the VRAM holds, as KVCacheGPU chooses); host_extent_pages: pinned host
    pages come in extents of this many; plan_max_tokens: the caches hold at most this many tokens."""
    if min(cpu_bytes_per_token, gpu_bytes_per_token, host_free_bytes, vram_free_bytes) < 0 or page_tokens < 1 \
            or host_extent_pages < 1 or (resident_pages is not None and resident_pages < 0):
        raise HelmcError("KV capacity: expected byte counts >= 0, page_tokens and host_extent_pages >= 1 and "
                         f"resident_pages >= 0, found {cpu_bytes_per_token}, {gpu_bytes_per_token}, {host_free_bytes}, "
                         f"{vram_free_bytes}, {page_tokens}, {host_extent_pages}, {resident_pages}")
    if not 0 < watermark <= 1:
        raise HelmcError(f"--kv-watermark expected in (0, 1], found {watermark}")
    T = page_tokens
    gpu_page = gpu_bytes_per_token * T
    unbounded = 1 << 62
    resident = 0
    if gpu_page == 0:                         # no GPU layers
        vram_pages = unbounded
    elif not offload:
        vram_pages = resident = vram_free_bytes // gpu_page
    else:
        slots = vram_free_bytes // gpu_page
        if resident_pages is not None:
            resident = min(resident_pages, slots)
        elif slots < 2:                       # no room to evict: what fits on the GPU is all there is
            resident = slots
        else:
            resident = gpu_resident_pages(slots, watermark, unbounded)
        vram_pages = slots if slots < 2 else unbounded
    cap = KVCapacity(tokens_fit=0, limited_by=HOST_RAM, page_tokens=T, cpu_bytes_per_token=cpu_bytes_per_token,
                     gpu_bytes_per_token=gpu_bytes_per_token, gpu_resident_pages=int(resident),
                     host_bytes_free=host_free_bytes, vram_bytes_free=vram_free_bytes, offload=offload,
                     model_max_tokens=model_max_tokens, host_extent_pages=host_extent_pages,
                     plan_max_tokens=plan_max_tokens)
    host_pages = _most_pages(lambda n: cap.host_bytes_needed(n * T) <= host_free_bytes, unbounded)
    window_pages = unbounded if model_max_tokens <= 0 else -(-model_max_tokens // T)
    plan_pages = unbounded if plan_max_tokens <= 0 else -(-plan_max_tokens // T)
    limits = [(plan_pages, 0, PLAN_LIMIT), (window_pages, 1, MODEL_WINDOW), (vram_pages, 2, VRAM),
              (host_pages, 3, HOST_RAM)]
    pages, _, limited_by = min(limits)
    tokens = {MODEL_WINDOW: model_max_tokens, PLAN_LIMIT: plan_max_tokens}.get(limited_by, pages * T)
    return replace(cap, tokens_fit=int(min(tokens, unbounded)), limited_by=limited_by)


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def refusal_message(cap: KVCapacity, prompt_tokens: int, new_tokens: int) -> str:
    """One line: tokens asked, tokens that fit, which memory runs out and by how much."""
    asked = prompt_tokens + new_tokens
    head = (f"context: prompt {prompt_tokens} + {new_tokens} new tokens = {asked} tokens do not fit; "
            f"at most {cap.tokens_fit} fit")
    if cap.limited_by == MODEL_WINDOW:
        return f"{head}: the model's context window is {cap.model_max_tokens} tokens"
    if cap.limited_by == PLAN_LIMIT:
        why = ("the model's context window" if cap.plan_max_tokens == cap.model_max_tokens else
               "the KV caches were sized for it from the free memory of the hardware profile the bundle was built "
               "for; rebuild with this machine's profile for more")
        return f"{head}: the plan allows at most {cap.plan_max_tokens} tokens ({why})"
    if cap.limited_by == VRAM:
        need = cap.pages(asked) * cap.gpu_bytes_per_token * cap.page_tokens
        hint = "; drop --no-kv-offload to move old KV pages to host RAM" if not cap.offload else ""
        return (f"{head}: VRAM runs out (GPU-layer KV of {asked} tokens needs {_size(need)}, "
                f"{_size(cap.vram_bytes_free)} free after weights and workspace){hint}")
    parts = f"CPU-layer KV {_size(cap.cpu_kv_bytes(asked))}"
    if cap.pinned_kv_bytes(asked):
        parts += f" + GPU-layer pages in pinned RAM {_size(cap.pinned_kv_bytes(asked))}"
    need = cap.host_bytes_needed(asked)
    return (f"{head}: host RAM runs out (KV of {asked} tokens needs {_size(need)} of host RAM: {parts}; "
            f"{_size(cap.host_bytes_free)} free, short by {_size(need - cap.host_bytes_free)})")


def check_request(cap: KVCapacity, prompt_tokens: int, new_tokens: int) -> None:
    """Raise HelmcError with refusal_message() when prompt + new tokens do not fit."""
    if not cap.fits(prompt_tokens + new_tokens):
        raise HelmcError(refusal_message(cap, prompt_tokens, new_tokens))


# -------------------------------------------------------------------- a session's caches
HOST_HEADROOM_BYTES = 256 << 20     # the runtime's own transient host memory: score tiles, logits, copies


def host_ram_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable: what the kernel can hand out without swapping; None where it does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_step_bytes(hidden: int, intermediate: int, q_dim: int, kv_dim: int, rows: int, cpu_blocks: bool) -> int:
    """Host memory one step holds besides KV, an estimate: with CPU blocks, their fp32 activations for
    `rows` tokens (x and residual, q/k/v, attention out, MLP gate/up/act); else the hidden state in
    and out. Plus HOST_HEADROOM_BYTES."""
    per_row = (2 * hidden + 2 * q_dim + 2 * kv_dim + 3 * intermediate) if cpu_blocks else 2 * hidden
    return HOST_HEADROOM_BYTES + 4 * rows * per_row


def caches_host_bytes_held(cpu_kv, gpu_kv, cpu_tokens_touched: int) -> int:
    """Host RAM the caches already hold and will reuse (MemAvailable no longer counts it): the CPU
    arena's pages up to the longest sequence so far (slots are handed out lowest first, and the OS
    commits them on first write), and the pinned extents of the GPU cache (kept across requests)."""
    held = 0
    if cpu_kv is not None:
        held += -(-cpu_tokens_touched // cpu_kv.page_tokens) * cpu_kv.page_tokens * _cpu_bytes_per_token(cpu_kv)
    if gpu_kv is not None and gpu_kv.offload:
        held += len(gpu_kv._extents) * gpu_kv.extent_pages * gpu_kv.page_bytes
    return held


def capacity_of_caches(cpu_kv, gpu_kv, host_free_bytes: int, model_max_tokens: int) -> KVCapacity:
    """What a session's caches can hold (KVCacheCPU of the CPU layers, KVCacheGPU of the GPU layers,
    either may be None): their layers, dtypes and page size, the GPU page pool and watermark they
    were built with, the tokens they were sized for, and `host_free_bytes` of host RAM for KV."""
    caches = [kv for kv in (cpu_kv, gpu_kv) if kv is not None]
    if not caches:
        raise HelmcError("KV capacity: expected at least one KV cache, found none")
    T = cpu_kv.page_tokens if cpu_kv is not None else gpu_kv.T
    if gpu_kv is not None and gpu_kv.T != T:
        raise HelmcError(f"KV capacity: CPU and GPU caches expected the same page size, found {T} and {gpu_kv.T}")
    cpu_bpt = _cpu_bytes_per_token(cpu_kv) if cpu_kv is not None else 0
    gpu_bpt = gpu_kv.page_bytes // T if gpu_kv is not None else 0
    return plan_kv_capacity(
        cpu_bpt, gpu_bpt, max(0, host_free_bytes),
        gpu_kv.gpu_pages * gpu_kv.page_bytes if gpu_kv is not None else 0,
        offload=gpu_kv.offload if gpu_kv is not None else True, page_tokens=T, model_max_tokens=model_max_tokens,
        resident_pages=gpu_kv.resident_limit if gpu_kv is not None and gpu_kv.offload else None,
        host_extent_pages=gpu_kv.extent_pages if gpu_kv is not None else 1,
        plan_max_tokens=min(kv.max_tokens for kv in caches))


def _cpu_bytes_per_token(cpu_kv) -> int:
    return kv_bytes_per_token(cpu_kv.num_layers, cpu_kv.num_kv_heads, cpu_kv.head_dim, cpu_kv.dtype.itemsize)
