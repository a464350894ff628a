"""Capacity planning for the KV cache: how many tokens fit before a request starts (issue 5).

helmc refuses a request that cannot fit, with the numbers, instead of failing midway. Where KV lives:
  - CPU-stage layers: host RAM, every token.
  - GPU-stage layers with offload: the newest `watermark` share of the VRAM left after weights and
    workspace holds pages on the GPU; older pages go to pinned host RAM.
  - GPU-stage layers without offload (--no-kv-offload): every token in VRAM.
Everything is counted in whole pages, as the caches allocate them. Pure arithmetic, no devices.
"""
from __future__ import annotations

from dataclasses import dataclass

from helmc.errors import HelmcError

GIB = 1024 ** 3
HOST_RAM, VRAM, MODEL_WINDOW = "host RAM", "VRAM", "the model's context window"


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
    limited_by: str                 # HOST_RAM | VRAM | MODEL_WINDOW
    page_tokens: int
    cpu_bytes_per_token: int        # KV of the CPU-stage layers (host RAM)
    gpu_bytes_per_token: int        # KV of the GPU-stage layers (VRAM, overflow in pinned host RAM)
    gpu_resident_pages: int         # pages of GPU-layer KV kept on the GPU
    host_bytes_free: int
    vram_bytes_free: int            # after weights and workspace
    offload: bool
    model_max_tokens: int

    @property
    def gpu_resident_tokens(self) -> int:
        return self.gpu_resident_pages * self.page_tokens

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def host_bytes_needed(self, tokens: int) -> int:
        n = self.pages(tokens)
        spill = max(0, n - self.gpu_resident_pages) if self.offload else 0
        return (n * self.cpu_bytes_per_token + spill * self.gpu_bytes_per_token) * self.page_tokens

    def vram_bytes_needed(self, tokens: int) -> int:
        n = self.pages(tokens)
        if self.offload:
            n = min(n, self.gpu_resident_pages)
        return n * self.gpu_bytes_per_token * self.page_tokens

    def fits(self, tokens: int) -> bool:
        return tokens <= self.tokens_fit


def plan_kv_capacity(cpu_bytes_per_token: int, gpu_bytes_per_token: int, host_free_bytes: int,
                     vram_free_bytes: int, watermark: float = 0.8, offload: bool = True,
                     page_tokens: int = 512, model_max_tokens: int = 0) -> KVCapacity:
    """The most tokens whose KV fits, and which memory runs out first.

    vram_free_bytes: VRAM left after weights and workspace (staging, partials, activations);
    host_free_bytes: host RAM helmc may use for KV; model_max_tokens: the model's native window
    (0: no limit)."""
    if min(cpu_bytes_per_token, gpu_bytes_per_token, host_free_bytes, vram_free_bytes) < 0 or page_tokens < 1:
        raise HelmcError("KV capacity: expected byte counts >= 0 and page_tokens >= 1, found "
                         f"{cpu_bytes_per_token}, {gpu_bytes_per_token}, {host_free_bytes}, {vram_free_bytes}, "
                         f"{page_tokens}")
    if not 0 < watermark <= 1:
        raise HelmcError(f"--kv-watermark expected in (0, 1], found {watermark}")
    T = page_tokens
    cpu_page, gpu_page = cpu_bytes_per_token * T, gpu_bytes_per_token * T
    unbounded = 1 << 62
    host_only = host_free_bytes // cpu_page if cpu_page else unbounded      # pages the CPU-layer KV allows
    resident = 0
    if gpu_page == 0:                         # no GPU layers
        vram_pages, host_pages = unbounded, host_only
    elif not offload:
        vram_pages, host_pages = vram_free_bytes // gpu_page, host_only
        resident = vram_pages
    else:
        slots = vram_free_bytes // gpu_page
        resident = gpu_resident_pages(slots, watermark, unbounded)
        if slots < 2:                         # no room to evict: what fits on the GPU is all there is
            vram_pages, host_pages = slots, host_only
        else:
            vram_pages = unbounded
            # n pages need n * cpu_page + (n - resident) * gpu_page of host RAM once n > resident
            spilling = (host_free_bytes + resident * gpu_page) // (cpu_page + gpu_page)
            host_pages = host_only if host_only <= resident else spilling
    window_pages = unbounded if model_max_tokens <= 0 else -(-model_max_tokens // T)
    limits = [(window_pages, 0, MODEL_WINDOW), (vram_pages, 1, VRAM), (host_pages, 2, HOST_RAM)]
    pages, _, limited_by = min(limits)
    tokens = model_max_tokens if limited_by == MODEL_WINDOW else pages * T
    return KVCapacity(tokens_fit=int(min(tokens, unbounded)), limited_by=limited_by, page_tokens=T,
                      cpu_bytes_per_token=cpu_bytes_per_token, gpu_bytes_per_token=gpu_bytes_per_token,
                      gpu_resident_pages=int(min(resident, unbounded)), host_bytes_free=host_free_bytes,
                      vram_bytes_free=vram_free_bytes, offload=offload, model_max_tokens=model_max_tokens)


def refusal_message(cap: KVCapacity, prompt_tokens: int, new_tokens: int) -> str:
    """One line: tokens asked, tokens that fit, which memory runs out and by how much."""
    asked = prompt_tokens + new_tokens
    head = (f"context: prompt {prompt_tokens} + {new_tokens} new tokens = {asked} tokens do not fit; "
            f"at most {cap.tokens_fit} fit")
    if cap.limited_by == MODEL_WINDOW:
        return f"{head}: the model's context window is {cap.model_max_tokens} tokens"
    if cap.limited_by == VRAM:
        need = cap.pages(asked) * cap.gpu_bytes_per_token * cap.page_tokens
        hint = "; drop --no-kv-offload to move old KV pages to host RAM" if not cap.offload else ""
        return (f"{head}: VRAM runs out (GPU-layer KV of {asked} tokens needs {need / GIB:.2f} GiB, "
                f"{cap.vram_bytes_free / GIB:.2f} GiB free after weights and workspace){hint}")
    return (f"{head}: host RAM runs out (KV of {asked} tokens needs {cap.host_bytes_needed(asked) / GIB:.2f} GiB "
            f"of host RAM, {cap.host_bytes_free / GIB:.2f} GiB free)")


def check_request(cap: KVCapacity, prompt_tokens: int, new_tokens: int) -> None:
    """Raise HelmcError with refusal_message() when prompt + new tokens do not fit."""
    if not cap.fits(prompt_tokens + new_tokens):
        raise HelmcError(refusal_message(cap, prompt_tokens, new_tokens))
