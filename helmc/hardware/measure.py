"""Hardware profiling (thesis 4.1.2): measure the machine the plan is made for, with the code helmc runs there.

CPU (helmc's own compiled kernels from a profile kit, helmc/hardware/kit.py; host_read.py):
  dram_gbs          helmc's stream-read kernel on every core over a buffer >= 4 x L3;
  host_read_gbs     helmc's fp16 decode GEMVs on every core over block-shaped weights >= 4 x L3, launched as the CPU
                    stage launches them (the cost model's M); gemv_reads the same per weight type;
  l3_gbs            the stream read re-reading half the L3;
  fp32_gflops       helmc's prefill GEMM, 128 tokens, on every core (P on the CPU: the compute term).
  Cores, features, L3 size and free RAM come from /sys, /proc/cpuinfo, /proc/meminfo and cgroups.
GPU (measure_gpu.py; cupy, else torch.cuda; HELMC_GPU_BACKEND=cupy|torch|none forces one): name, arch, free VRAM,
HBM bandwidth, P_pre, pinned host<->device bandwidth and l_link; with CuPy, the DRAM + PCIe window
(concurrent.py): copies to the GPU while helmc's GEMVs run on every core, both rates from one window.
Per-block overheads come from helmc's compiled stages on the kit's synthetic model (planner/calibrate.py,
synthetic_overheads); helmc.api.profile runs everything in order and builds the kit where the compiler is.

What cannot be measured is listed in `unmeasured` with the reason, never guessed; a figure implausible against
the others even when measured again, in `doubtful` (host_read.recheck).
Run alone (TVM runtime only): python -m helmc.hardware.measure --kit KIT_DIR -o hardware.json [--quick]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass

from helmc.hardware.kit import ProfileKit, check_kit_runs_here
from helmc.hardware.measure_gpu import GpuMeasurement, measure_gpu
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


# ---- CPU ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuFacts:
    """What the CPU is, before anything is timed (what a kit is compiled for)."""
    name: str
    features: tuple[str, ...]
    cores: int
    threads: int
    l3_bytes: int
    l3_instances: int
    ram_total_bytes: int
    ram_free_bytes: int
    unmeasured: tuple[str, ...]
    notes: tuple[str, ...]


def cpu_facts() -> CpuFacts:
    unmeasured = []
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
    note = (f"cpu: {threads} hardware threads, {cores} cores, L3 {l3 / MIB:.0f} MiB in {l3_instances} instance(s); "
            f"free RAM from {ram_where}")
    return CpuFacts(name, tuple(flags), cores, threads, l3, l3_instances, total, max(1, min(avail, total)),
                    tuple(unmeasured), (note,))


def measure_cpu(kit_dir: str, kit: ProfileKit, facts: CpuFacts, progress=lambda m: None,
                pinned: bool = False) -> tuple[CpuProfile, list[str], tuple[str, ...]]:
    """(the CPU part of the profile, notes, doubtful figures): facts plus helmc's kernels' read rates (kit built for
    this CPU's flags), over pinned memory where the runtime would pin the CPU blocks (a GPU is present)."""
    from helmc.hardware.host_read import measure_host_reads
    check_kit_runs_here(kit, facts.features)
    notes = list(facts.notes)
    if kit.l3_bytes < facts.l3_bytes or kit.cores != facts.cores:
        notes.append(f"cpu: the kit was built for {kit.cores} cores and an L3 of {kit.l3_bytes >> 20} MiB, this CPU "
                     f"has {facts.cores} and {facts.l3_bytes >> 20} MiB: its reads may be sized for another cache")
    reads = measure_host_reads(kit_dir, kit, passes=3 if kit.quick else 5, progress=progress, pinned=pinned,
                               rounds=1 if kit.quick else 3)
    notes += list(reads.notes)
    if kit.quick:
        notes.append("quick mode: small buffers and a small block; the figures are not fit for planning")
    cpu = CpuProfile(name=facts.name, cores=facts.cores, threads=facts.threads, features=facts.features,
                     l3_bytes=facts.l3_bytes, dram_gbs=reads.dram_gbs, host_read_gbs=reads.host_read_gbs,
                     gemv_reads=reads.gemv_reads, l3_gbs=reads.l3_gbs, fp32_gflops=reads.gemm_gflops,
                     attention_read_gbs=reads.attention_gbs,
                     ram_total_bytes=facts.ram_total_bytes, ram_free_bytes=facts.ram_free_bytes)
    return cpu, notes, reads.doubtful


# ---- the whole profile ---------------------------------------------------------------------------------
def _gpu_steps(kit_dir: str, kit: ProfileKit, progress, cpu_gbs: float):
    """measure_gpu's `then`: helmc's GPU decode GEMVs per weight type (gpu.gemv_reads), then the DRAM + PCIe
    window, on the open backend (CuPy only); cpu_gbs: the fp16 GEMVs' read measured before."""
    import dataclasses
    window = _concurrent_step(kit_dir, kit, progress, cpu_gbs)

    def then(be, m: GpuMeasurement) -> GpuMeasurement:
        why = ("" if be.name == "cupy" else f"the {be.name} backend cannot run TVM kernels on its memory (CuPy can)")
        if not kit.gpu_gemv_kernels:
            why = "the profile kit has no GPU GEMVs (built without a GPU arch, or by an older helmc)"
        elif kit.gpu_arch != m.gpu.arch:
            why = f"the profile kit's GPU GEMVs are for {kit.gpu_arch}, this GPU is {m.gpu.arch}"
        if why:
            m = dataclasses.replace(m, unmeasured=m.unmeasured + (f"gpu.gemv_reads: {why}",))
        else:
            from helmc.hardware.measure_gpu_gemv import measure_gpu_gemv_reads
            progress("gpu: helmc's decode GEMVs per weight type")
            try:
                reads, notes = measure_gpu_gemv_reads(kit_dir, kit, be.cp)
                m = dataclasses.replace(m, gpu=dataclasses.replace(m.gpu, gemv_reads=reads), notes=m.notes + notes)
            except Exception as e:                   # a failed measurement is said, not invented
                m = dataclasses.replace(m, unmeasured=m.unmeasured + (
                    f"gpu.gemv_reads: failed ({type(e).__name__}: {e})",))
        return window(be, m)
    return then


def _concurrent_step(kit_dir: str, kit: ProfileKit, progress, cpu_gbs: float):
    """measure_gpu's `then`: the DRAM + PCIe window on the open backend (CuPy only)."""
    import dataclasses

    def then(be, m: GpuMeasurement) -> GpuMeasurement:
        if not hasattr(be, "queue_h2d"):
            return dataclasses.replace(m, unmeasured=m.unmeasured + (
                f"link.h2d_concurrent_gbs, link.cpu_read_concurrent_gbs: the {be.name} backend cannot queue "
                f"copies with events (CuPy can)",))
        from helmc.hardware.concurrent import measure_concurrent
        from helmc.hardware.host_read import Arena, GemvPass, KitLibrary, arena_bytes
        try:
            lib = KitLibrary(kit_dir, kit)
            gemv = GemvPass(lib, Arena(arena_bytes(kit), pinned=True), "float16")   # as hybrid decode's blocks
            r = measure_concurrent(be, gemv, m.link.h2d_gbs, seconds=0.3 if kit.quick else 1.0,
                                   chunk=(16 if kit.quick else 256) << 20, host_bytes=(64 << 20) if kit.quick else GIB,
                                   progress=progress, cpu_gbs_hint=cpu_gbs)
        except Exception as e:                       # a failed window is said, not invented
            return dataclasses.replace(m, unmeasured=m.unmeasured + (
                f"link.h2d_concurrent_gbs, link.cpu_read_concurrent_gbs: failed ({type(e).__name__}: {e})",))
        link = dataclasses.replace(m.link, h2d_concurrent_gbs=r.h2d_gbs, cpu_read_concurrent_gbs=r.cpu_gbs)
        note = (f"DRAM + PCIe at once ({r.window_s:.2f} s window, median of 3): helmc's fp16 GEMVs read "
                f"{r.cpu_gbs:.1f} GB/s (alone {r.cpu_alone_gbs:.1f}) while copies to the GPU moved {r.h2d_gbs:.1f} "
                f"GB/s (alone {r.h2d_alone_gbs:.1f}): {r.combined_gbs:.1f} GB/s of host memory together")
        return dataclasses.replace(m, link=link, notes=m.notes + (note,), doubtful=m.doubtful + r.doubtful)
    return then


def profile(kit_dir: str, quick: bool = False, gpu_backend: str | None = None, progress=lambda m: None,
            facts: CpuFacts | None = None) -> HardwareProfile:
    """Measure this machine with the kit in kit_dir (rates only: per-block overheads are
    planner.calibrate.synthetic_overheads'). quick: a quick kit's small sizes, and quick GPU sizes."""
    from helmc.hardware.measure_gpu import open_backend
    facts = facts or cpu_facts()
    kit = ProfileKit.load(kit_dir)
    backend = gpu_backend or os.environ.get("HELMC_GPU_BACKEND")
    be, _ = open_backend(backend)
    pinned = be is not None and be.name == "cupy"      # the runtime pins CPU blocks (with CuPy) beside a GPU
    if be is not None:
        be.release()
    cpu, notes, doubtful = measure_cpu(kit_dir, kit, facts, progress, pinned=pinned)
    if be is not None:
        progress(f"gpu: HBM, fp16 matmul and the link ({be.name})" + (", then the DRAM + PCIe window" if pinned else ""))
    g: GpuMeasurement = measure_gpu(quick, backend, then=_gpu_steps(kit_dir, kit, progress, cpu.host_read_gbs))
    return HardwareProfile(format_version=PROFILE_FORMAT_VERSION, cpu=cpu, gpu=g.gpu, link=g.link, source="measured",
                           unmeasured=facts.unmeasured + g.unmeasured, notes=tuple(notes) + g.notes,
                           doubtful=doubtful + g.doubtful)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helmc.hardware.measure", description=__doc__.splitlines()[0])
    ap.add_argument("--kit", required=True, help="a profile kit directory (helmc profile --build-kit DIR)")
    ap.add_argument("-o", "--output", default="hardware.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu-backend", choices=["cupy", "torch", "none"])
    args = ap.parse_args(argv)
    hw = profile(args.kit, quick=args.quick, gpu_backend=args.gpu_backend,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    hw.save(args.output)
    print(hw.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
