"""GPU and link micro-benchmarks for `helmc profile` (thesis 4.1.2 (i)-(iii)).

Runs through CuPy where importable, else torch.cuda; both behind one small backend interface so
the same measurement code runs on either (and, in the tests, on numpy or torch CPU arrays, which
checks the arithmetic without a GPU). Every figure that fails is listed as unmeasured with the
exception text; a GPU whose HBM bandwidth or link cannot be measured is left out of the profile.
The GPU's per-block overhead comes from helmc's compiled GPU stage (planner/calibrate.py, synthetic_overheads),
not from array-library ops (their launches are not the stage's); the DRAM + PCIe rates from concurrent.py.
"""
from __future__ import annotations

import glob
import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional

from helmc.hardware.profile import GpuProfile, LinkProfile

MIB = 1024 ** 2
GIB = 1024 ** 3
LATENCY_PROBE_BYTES = 8192          # W_act of Qwen3-8B at B = 1 (thesis eq. 4.4)


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    major: int
    minor: int
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class GpuMeasurement:
    gpu: Optional[GpuProfile] = None
    link: Optional[LinkProfile] = None
    unmeasured: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    doubtful: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchSizes:
    gemv_bytes: int = GIB           # capped at a quarter of free VRAM
    link_bytes: int = 256 * MIB
    latency_reps: int = 200
    matmul_inner: int = 50
    matmul_m: int = 128             # thesis 4.1.2 (ii): (128, H) x (H, H)
    matmul_h: int = 4096


QUICK_SIZES = BenchSizes(gemv_bytes=64 * MIB, link_bytes=16 * MIB, latency_reps=20, matmul_inner=5)


# ---- backends --------------------------------------------------------------------------------------
class ArrayBackend:
    """Array maths shared by CuPy and (in tests) numpy: the same API under `xp`."""
    name = "array"

    def __init__(self, xp):
        self.xp = xp

    def full(self, shape, value, dtype: str):
        return self.xp.full(shape, value, dtype=dtype)

    def matmul(self, a, b):
        return a @ b

    def copy(self, dst, src):
        self.xp.copyto(dst, src)

    def rms(self, x, w, eps: float = 1e-6):
        xf = x.astype(self.xp.float32)
        r = 1.0 / self.xp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)
        return (xf * r).astype(x.dtype) * w

    def silu(self, x):
        return x / (1 + self.xp.exp(-x))

    def softmax(self, x):
        e = self.xp.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def rotate_half(self, x):
        h = x.shape[-1] // 2
        return self.xp.concatenate((-x[..., h:], x[..., :h]), axis=-1)

    def transpose_last(self, x):
        return self.xp.swapaxes(x, -1, -2)


class CupyBackend(ArrayBackend):
    name = "cupy"

    def __init__(self, cupy):
        super().__init__(cupy)
        self.cp = cupy
        self.rt = cupy.cuda.runtime

    def info(self) -> DeviceInfo:
        dev = self.cp.cuda.Device().id
        props = self.rt.getDeviceProperties(dev)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        free, total = self.rt.memGetInfo()
        return DeviceInfo(name=name, major=int(props["major"]), minor=int(props["minor"]),
                          free_bytes=int(free), total_bytes=int(total))

    def sync(self):
        self.cp.cuda.Device().synchronize()

    def time_ms(self, fn, inner: int) -> float:
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end)

    def pinned(self, nbytes: int):
        return self.cp.cuda.alloc_pinned_memory(nbytes)

    def h2d(self, dev, host, nbytes: int):
        self.rt.memcpy(dev.data.ptr, host.ptr, nbytes, getattr(self.rt, "memcpyHostToDevice", 1))

    def d2h(self, host, dev, nbytes: int):
        self.rt.memcpy(host.ptr, dev.data.ptr, nbytes, getattr(self.rt, "memcpyDeviceToHost", 2))

    def queue_h2d(self, dev, host, host_bytes: int, chunk: int, count: int):
        """`count` async copies of `chunk` bytes from successive offsets of pinned `host` into `dev`, each followed
        by an event, on a stream of their own; returns a handle for copy_end_times. Nothing here waits for them."""
        cp, rt = self.cp, self.rt
        stream = cp.cuda.Stream(non_blocking=True)
        e0 = cp.cuda.Event()
        e0.record(stream)
        e0.synchronize()
        t0 = time.perf_counter()                 # the host time of e0 (an idle stream records it at once)
        events, slots = [], max(1, host_bytes // chunk)
        kind = getattr(rt, "memcpyHostToDevice", 1)
        for i in range(count):
            rt.memcpyAsync(dev.data.ptr, host.ptr + (i % slots) * chunk, chunk, kind, stream.ptr)
            e = cp.cuda.Event()
            e.record(stream)
            events.append(e)
        return (stream, t0, e0, events)

    def copies_done(self, handle) -> bool:
        return handle[3][-1].done                 # cudaEventQuery: no wait

    def copy_end_times(self, handle) -> list[float]:
        """Host-clock time (perf_counter) at which each queued copy finished; waits for all of them."""
        stream, t0, e0, events = handle
        stream.synchronize()
        return [t0 + self.cp.cuda.get_elapsed_time(e0, e) * 1e-3 for e in events]

    def release(self):
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()


class TorchBackend:
    name = "torch"

    def __init__(self, torch, device: str = "cuda"):
        self.torch = torch
        self.device = device

    def info(self) -> DeviceInfo:
        t = self.torch
        free, total = t.cuda.mem_get_info()
        major, minor = t.cuda.get_device_capability()
        return DeviceInfo(name=t.cuda.get_device_name(), major=major, minor=minor, free_bytes=int(free),
                          total_bytes=int(total))

    def full(self, shape, value, dtype: str):
        return self.torch.full(shape, value, dtype=getattr(self.torch, dtype), device=self.device)

    def matmul(self, a, b):
        return a @ b

    def copy(self, dst, src):
        dst.copy_(src)

    def rms(self, x, w, eps: float = 1e-6):
        xf = x.float()
        return (xf * self.torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def silu(self, x):
        return x / (1 + self.torch.exp(-x))

    def softmax(self, x):
        return self.torch.softmax(x, dim=-1)

    def rotate_half(self, x):
        h = x.shape[-1] // 2
        return self.torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    def transpose_last(self, x):
        return x.transpose(-1, -2)

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def time_ms(self, fn, inner: int) -> float:
        if self.device != "cuda":
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def pinned(self, nbytes: int):
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.device == "cuda")

    def h2d(self, dev, host, nbytes: int):
        dev[:nbytes].copy_(host[:nbytes])
        self.sync()

    def d2h(self, host, dev, nbytes: int):
        host[:nbytes].copy_(dev[:nbytes])
        self.sync()

    def release(self):
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def open_backend(name: str | None):
    """(backend, "") or (None, why there is none). name: cupy | torch | none | None (try both)."""
    if name == "none":
        return None, "HELMC_GPU_BACKEND=none"
    if name not in (None, "cupy", "torch"):
        return None, f"HELMC_GPU_BACKEND expected cupy, torch or none, found {name!r}"
    if name is None and not _nvidia_driver_present():
        return None, "no NVIDIA driver (/proc/driver/nvidia/version and /dev/nvidia* absent)"
    reasons = []
    for cand in [name] if name else ["cupy", "torch"]:
        try:
            if cand == "cupy":
                import cupy
                if cupy.cuda.runtime.getDeviceCount() < 1:
                    raise RuntimeError("no CUDA device")
                return CupyBackend(cupy), ""
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            return TorchBackend(torch), ""
        except Exception as e:                       # ImportError, CUDA driver errors: say which and go on
            reasons.append(f"{cand}: {type(e).__name__}: {e}")
    return None, "; ".join(reasons)


# ---- measurements -------------------------------------------------------------------------------------
def _median_ms(be, fn, inner: int, trials: int = 3) -> float:
    fn()
    be.sync()
    return statistics.median(be.time_ms(fn, inner) for _ in range(trials)) / inner


def wall_median_s(fn, reps: int) -> float:
    """Median wall time of `reps` calls after one warm-up call (page faults, thread start, JIT)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemv_gbs(be, nbytes: int, k: int = 4096) -> float:
    """M on the GPU: x[1,K] @ W[K,N] in fp16, W of nbytes (the decode pattern)."""
    n = max(1, nbytes // (2 * k))
    w = be.full((k, n), 0.001, "float16")                     # [K, N]
    x = be.full((1, k), 1.0, "float16")                       # [1, K]
    return 2 * k * n / (_median_ms(be, lambda: be.matmul(x, w), inner=10) * 1e-3) / 1e9


def copy_gbs(be, nbytes: int) -> float:
    """Device copy, counting read + write (the thesis's 64 MB copy, at a larger size)."""
    src = be.full((nbytes // 4,), 1.0, "float16")
    dst = be.full((nbytes // 4,), 0.0, "float16")
    return nbytes / (_median_ms(be, lambda: be.copy(dst, src), inner=5) * 1e-3) / 1e9


def matmul_tflops(be, m: int = 128, h: int = 4096, inner: int = 50) -> float:
    """P_pre (thesis 4.1.2 (ii)): (128, H) x (H, H) in fp16."""
    a = be.full((m, h), 0.01, "float16")                      # [128, H]
    b = be.full((h, h), 0.01, "float16")                      # [H, H]
    return 2 * m * h * h / (_median_ms(be, lambda: be.matmul(a, b), inner=inner) * 1e-3) / 1e12


def link_figures(be, nbytes: int, latency_reps: int) -> tuple[LinkProfile, str]:
    """B_link both ways over pinned memory and l_link from 8 KB copies (eq. 4.15: t = l + W / B)."""
    host = be.pinned(nbytes)
    dev = be.full((nbytes,), 0, "uint8")
    h2d = nbytes / wall_median_s(lambda: be.h2d(dev, host, nbytes), reps=5) / 1e9
    d2h = nbytes / wall_median_s(lambda: be.d2h(host, dev, nbytes), reps=5) / 1e9
    t_small = wall_median_s(lambda: be.h2d(dev, host, LATENCY_PROBE_BYTES), reps=latency_reps)
    latency_us = max(0.0, t_small * 1e6 - LATENCY_PROBE_BYTES / (h2d * 1e9) * 1e6)
    note = (f"link: pinned {nbytes / MIB:.0f} MiB copies H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s; one "
            f"{LATENCY_PROBE_BYTES} B H2D copy with synchronisation {t_small * 1e6:.1f} us, so l_link = "
            f"{latency_us:.1f} us (median of {latency_reps})")
    return LinkProfile(h2d_gbs=round(h2d, 2), d2h_gbs=round(d2h, 2), latency_us=round(latency_us, 2)), note


def run_gpu_benchmarks(be, sizes: BenchSizes) -> GpuMeasurement:
    info = be.info()
    unmeasured, notes = [], [f"gpu: measured with {be.name}; {info.name}, compute capability {info.major}.{info.minor}, "
                             f"{info.free_bytes / GIB:.2f} of {info.total_bytes / GIB:.2f} GiB free with a CUDA context"]
    big = int(min(sizes.gemv_bytes, info.free_bytes // 4))
    try:
        hbm = gemv_gbs(be, big)
    except Exception as e:
        return GpuMeasurement(unmeasured=(f"gpu, link: HBM benchmark failed ({type(e).__name__}: {e})",),
                              notes=tuple(notes))
    notes.append(f"gpu: hbm_gbs {hbm:.0f} from an fp16 GEMV over {big / MIB:.0f} MiB of weights (median of 3 x 10 calls)")
    try:
        notes.append(f"gpu: device copy {copy_gbs(be, big):.0f} GB/s counting read + write (not used by the cost model)")
    except Exception as e:
        notes.append(f"gpu: device copy benchmark failed ({type(e).__name__}: {e})")
    tflops = 0.0
    try:
        m, h = sizes.matmul_m, sizes.matmul_h
        tflops = matmul_tflops(be, m=m, h=h, inner=sizes.matmul_inner)
        notes.append(f"gpu: fp16_tflops {tflops:.1f} from ({m}, {h}) x ({h}, {h}) fp16 matmuls (thesis 4.1.2 (ii))")
    except Exception as e:
        unmeasured.append(f"gpu.fp16_tflops: matmul benchmark failed ({type(e).__name__}: {e})")
    try:
        link, note = link_figures(be, sizes.link_bytes, latency_reps=sizes.latency_reps)
        notes.append(note)
    except Exception as e:
        return GpuMeasurement(unmeasured=tuple(unmeasured) + (f"gpu, link: link benchmark failed ({type(e).__name__}: {e})",),
                              notes=tuple(notes))
    gpu = GpuProfile(name=info.name, arch=f"sm_{info.major}{info.minor}", vram_total_bytes=info.total_bytes,
                     vram_free_bytes=info.free_bytes, hbm_gbs=round(hbm, 1), fp16_tflops=round(tflops, 2))
    return GpuMeasurement(gpu=gpu, link=link, unmeasured=tuple(unmeasured), notes=tuple(notes))


def probe_arch(backend: str | None = None) -> tuple[str, str]:
    """(CUDA arch like "sm_90", "") of this machine's GPU, or ("", why there is none): what a kit is compiled for."""
    be, why = open_backend(backend)
    if be is None:
        return "", why
    try:
        info = be.info()
        return f"sm_{info.major}{info.minor}", ""
    except Exception as e:                           # a driver that lists a device it cannot open
        return "", f"{type(e).__name__}: {e}"
    finally:
        be.release()


def measure_gpu(quick: bool = False, backend: str | None = None, then=None) -> GpuMeasurement:
    """The GPU and link figures; then(backend, measurement) -> measurement runs further measurements on the
    open backend (the DRAM + PCIe window) before it is released."""
    be, why = open_backend(backend)
    if be is None:
        return GpuMeasurement(unmeasured=(f"gpu, link: {why}",))
    try:
        m = run_gpu_benchmarks(be, QUICK_SIZES if quick else BenchSizes())
        return then(be, m) if then is not None and m.gpu is not None else m
    finally:
        be.release()
