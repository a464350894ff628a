"""Hardware profiling (thesis 4.1.2): measure the machine the plan is made for.

CPU (numpy, one thread per usable hardware thread, each reducing its own part of memory):
  dram_gbs          one buffer >= 8 x L3, each thread reading a contiguous slice;
  dram_strided_gbs  the inference-like pattern: many separately allocated matrices shaped like a
                    transformer block's weights, visited in order, each read by all threads in
                    interleaved 16-row tiles (the TLB and allocation effects thesis 7.1 says a
                    single 64 MB copy misses);
  l3_gbs            each thread re-reading a slice that fits in its share of L3;
  fp32_gflops       numpy (BLAS) sgemm.
  Cores, features, L3 size and free RAM come from /sys, /proc/cpuinfo, /proc/meminfo and cgroups.
GPU (cupy, else torch.cuda; HELMC_GPU_BACKEND=cupy|torch|none forces one): name, arch, free VRAM,
HBM bandwidth (fp16 GEMV over a large matrix, the decode pattern), P_pre ((128,4096) x (4096,4096)
fp16 matmul), pinned host<->device bandwidth (256 MiB) and l_link (8 KB copies), and the
per-block overhead delta of thesis 6.4.4: a Qwen3-8B-shaped decode block run op by op, minus its
roofline time at the measured HBM bandwidth.

What cannot be measured is listed in `unmeasured` with the reason, never guessed.
Run alone: python -m helmc.hardware.measure -o hardware.json [--quick]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from helmc.hardware.measure_gpu import GpuMeasurement, measure_gpu, wall_median_s
from helmc.hardware.profile import PROFILE_FORMAT_VERSION, CpuProfile, HardwareProfile

MIB = 1024 ** 2
GIB = 1024 ** 3


# ---- static facts ------------------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpuinfo_field(text: str, key: str) -> str | None:
    for line in text.splitlines():
        if ":" in line and line.split(":", 1)[0].strip() == key:
            return line.split(":", 1)[1].strip()
    return None


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1024, "M": MIB, "G": GIB}.get(text[-1:], 1)
    return int(float(text.rstrip("KMGB") or 0) * mult)


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:                       # not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int | None:
    seen = set()
    for c in cpus:
        core = _read(f"/sys/devices/system/cpu/cpu{c}/topology/core_id")
        pkg = _read(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id")
        if core is None or pkg is None:
            return None
        seen.add((pkg.strip(), core.strip()))
    return len(seen) or None


def l3_total_bytes(cpus: list[int]) -> tuple[int, int]:
    """(bytes summed over the distinct L3 instances the allowed CPUs use, number of instances)."""
    instances = {}
    for c in cpus:
        for d in glob.glob(f"/sys/devices/system/cpu/cpu{c}/cache/index*"):
            if (_read(os.path.join(d, "level")) or "").strip() != "3":
                continue
            shared = (_read(os.path.join(d, "shared_cpu_list")) or str(c)).strip()
            size = _read(os.path.join(d, "size"))
            if size:
                instances[shared] = _parse_size(size)
    if instances:
        return sum(instances.values()), len(instances)
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        return (size, 1) if size > 0 else (0, 0)
    except (ValueError, OSError, AttributeError):
        return 0, 0


def ram_bytes() -> tuple[int, int, str]:
    """(total, available, where from): /proc/meminfo, lowered by a cgroup memory limit if any."""
    info = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            info[parts[0].rstrip(":")] = int(parts[1]) * 1024
    total = info.get("MemTotal", 0)
    avail = info.get("MemAvailable", info.get("MemFree", 0))
    where = "/proc/meminfo MemAvailable"
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read(limit_path), _read(usage_path)
        if limit and limit.strip().isdigit() and usage and usage.strip().isdigit():
            lim = int(limit)
            if 0 < lim < total:
                total, avail = lim, min(avail, max(0, lim - int(usage)))
                where = f"cgroup limit {limit_path}"
            break
    return total, avail, where


# ---- CPU bandwidth -------------------------------------------------------------------------------


def _filled(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes // 4, np.float32)
    a.fill(1.0)                                   # touch every page before timing
    return a


def contiguous_read_gbs(pool: ThreadPoolExecutor, threads: int, nbytes: int, reps: int) -> float:
    buf = _filled(nbytes)
    parts = np.array_split(buf, threads)
    t = wall_median_s(lambda: list(pool.map(np.maximum.reduce, parts)), reps)
    return buf.nbytes / t / 1e9


def block_shaped_matrices(nbytes: int, hidden: int) -> list[np.ndarray]:
    """Separately allocated fp32 matrices in the proportions of a Qwen3 block (q, k, v, o, gate,
    up, down with kv = hidden/4, ffn = 3 hidden), as many blocks as fit in nbytes."""
    shapes = [(hidden, hidden), (hidden // 4, hidden), (hidden // 4, hidden), (hidden, hidden),
              (3 * hidden, hidden), (3 * hidden, hidden), (hidden, 3 * hidden)]
    per_block = sum(r * c for r, c in shapes) * 4
    mats = []
    for _ in range(max(1, nbytes // per_block)):
        for r, c in shapes:
            m = np.empty((r, c), np.float32)      # one allocation each, as checkpoints load them
            m.fill(1.0)
            mats.append(m)
    return mats


def interleaved_tiles(m: np.ndarray, threads: int, tile_rows: int) -> list[np.ndarray]:
    """Thread i's rows of m: tiles i, i+T, i+2T, ... as one strided view (no copy)."""
    rows, cols = m.shape
    usable = rows // (tile_rows * threads) * tile_rows * threads
    if usable == 0:
        return [m] if threads == 1 else list(np.array_split(m, threads))
    tiled = m[:usable].reshape(-1, threads, tile_rows, cols)     # [n_tiles / T, T, tile_rows, cols]
    return [tiled[:, i] for i in range(threads)]                  # each [n_tiles / T, tile_rows, cols]


def inference_like_read_gbs(pool: ThreadPoolExecutor, threads: int, nbytes: int, reps: int,
                            hidden: int = 1024, tile_rows: int = 16) -> float:
    mats = block_shaped_matrices(nbytes, hidden)
    tiles = [interleaved_tiles(m, threads, tile_rows) for m in mats]
    per_thread = [[t[i] for t in tiles] for i in range(threads)]     # thread i: its tiles of every matrix, in order

    def walk(views):
        # No barrier between matrices: a Python fork-join per matrix would cost more than a native
        # kernel's and measure the interpreter, not the memory.
        for v in views:
            np.maximum.reduce(v, axis=None)
    t = wall_median_s(lambda: list(pool.map(walk, per_thread)), reps)
    return sum(m.nbytes for m in mats) / t / 1e9


def cache_read_gbs(pool: ThreadPoolExecutor, threads: int, nbytes: int, inner: int, reps: int) -> float:
    buf = _filled(nbytes)
    parts = np.array_split(buf, threads)

    def reread(p):
        for _ in range(inner):
            np.maximum.reduce(p)
    t = wall_median_s(lambda: list(pool.map(reread, parts)), reps)
    return buf.nbytes * inner / t / 1e9


def sgemm_gflops(n: int, reps: int) -> float:
    a = np.ones((n, n), np.float32)
    b = np.ones((n, n), np.float32)
    t = wall_median_s(lambda: a @ b, reps)
    return 2 * n ** 3 / t / 1e9


def measure_cpu(quick: bool = False) -> tuple[CpuProfile, list[str], list[str]]:
    unmeasured, notes = [], []
    cpuinfo = _read("/proc/cpuinfo") or ""
    name = _cpuinfo_field(cpuinfo, "model name") or _cpuinfo_field(cpuinfo, "Model name") or "unknown CPU"
    flags = (_cpuinfo_field(cpuinfo, "flags") or _cpuinfo_field(cpuinfo, "Features") or "").split()
    if not flags:
        unmeasured.append("cpu.features: /proc/cpuinfo has no flags line")
    cpus = allowed_cpus()
    threads = len(cpus)
    cores = physical_cores(cpus)
    if cores is None:
        cores = threads
        unmeasured.append("cpu.cores: no /sys topology; counted hardware threads instead")
    l3, l3_instances = l3_total_bytes(cpus)
    if not l3:
        unmeasured.append("cpu.l3_bytes: no L3 in /sys/devices/system/cpu/*/cache or sysconf")
    total, avail, ram_where = ram_bytes()
    notes.append(f"cpu: {threads} hardware threads, {cores} cores, L3 {l3 / MIB:.0f} MiB in {l3_instances} "
                 f"instance(s); free RAM from {ram_where}")

    big = 64 * MIB if quick else int(min(2 * GIB, max(512 * MIB, 8 * l3), avail // 8))
    reps = 3 if quick else 5
    with ThreadPoolExecutor(threads) as pool:
        dram = contiguous_read_gbs(pool, threads, big, reps)
        strided = inference_like_read_gbs(pool, threads, big, reps, hidden=512 if quick else 2048)
        l3_gbs = 0.0
        if l3:
            per_instance = l3 // max(1, l3_instances)
            # Half of each thread's share of its L3 instance, so the slice stays cached between passes.
            slice_bytes = max(64 * 1024, per_instance // max(1, threads // max(1, l3_instances)) // 2)
            l3_gbs = cache_read_gbs(pool, threads, slice_bytes * threads, inner=10 if quick else 50, reps=reps)
        else:
            unmeasured.append("cpu.l3_gbs: L3 size unknown")
    gflops = sgemm_gflops(512 if quick else 2048, reps=3)
    notes.append(f"cpu: dram {dram:.1f} GB/s over one {big / MIB:.0f} MiB buffer; inference-like {strided:.1f} GB/s "
                 f"over the same volume of block-shaped matrices; L3 {l3_gbs:.1f} GB/s; sgemm "
                 f"{gflops:.0f} GFLOP/s (numpy {np.__version__}); each the median of {reps} passes")
    if quick:
        notes.append("quick mode: small buffers; the bandwidth figures are not fit for planning")
    cpu = CpuProfile(name=name, cores=cores, threads=threads, features=tuple(flags), l3_bytes=l3, dram_gbs=round(dram, 2),
                     dram_strided_gbs=round(strided, 2), l3_gbs=round(l3_gbs, 2), fp32_gflops=round(gflops, 1),
                     ram_total_bytes=total, ram_free_bytes=max(1, min(avail, total)))
    return cpu, unmeasured, notes


# ---- the whole profile ---------------------------------------------------------------------------
def profile(quick: bool = False, gpu_backend: str | None = None) -> HardwareProfile:
    """Measure this machine. quick: small buffers (tests; under ~3 s on a CPU-only machine)."""
    cpu, unmeasured, notes = measure_cpu(quick)
    g: GpuMeasurement = measure_gpu(quick, gpu_backend or os.environ.get("HELMC_GPU_BACKEND"))
    unmeasured += g.unmeasured
    notes += g.notes
    return HardwareProfile(format_version=PROFILE_FORMAT_VERSION, cpu=cpu, gpu=g.gpu, link=g.link,
                           block_overhead_ms=g.block_overhead_ms, source="measured",
                           unmeasured=tuple(unmeasured), notes=tuple(notes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helmc.hardware.measure", description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="hardware.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu-backend", choices=["cupy", "torch", "none"])
    args = ap.parse_args(argv)
    hw = profile(quick=args.quick, gpu_backend=args.gpu_backend)
    hw.save(args.output)
    print(hw.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
