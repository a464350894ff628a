"""`helmc profile`'s measurements: the CPU side on this machine with helmc's own kernels (quick kit), the GPU
side's arithmetic through stand-in backends (numpy and torch on the CPU), and the real GPU where there is one
(pytest -m gpu; skipped without CuPy or a GPU). The DRAM + PCIe window and the kernels' read against
benchmarks/bench_cpu_gemv.py are in test_host_read.py."""
import time

import numpy as np
import pytest

from helmc.hardware import measure_gpu as mg
from helmc.hardware.profile import HardwareProfile
from helmc.hardware.kit import FLOAT_TYPES, QUANT_TYPES
from helmc.hardware.measure import _parse_size, l3_total_bytes, ram_bytes
from tests.gpu_prebuilt import cuda_device

TINY = mg.BenchSizes(gemv_bytes=2 * mg.MIB, link_bytes=4 * mg.MIB, latency_reps=5, matmul_inner=1, matmul_m=16,
                     matmul_h=256)
WEIGHT_TYPES = FLOAT_TYPES + QUANT_TYPES            # every type the kit measures, in its order (the registry's)
assert WEIGHT_TYPES[:2] == ("float16", "bfloat16") and {"q8_0", "q4_0", "q4_k", "q6_k"} <= set(WEIGHT_TYPES)


def test_quick_profile_on_this_machine(tmp_path):
    from helmc.api import profile
    profile(quick=True, gpu_backend="none", overheads=False, progress=lambda m: None)   # the kit, cached
    t0 = time.perf_counter()
    hw = profile(quick=True, gpu_backend="none", overheads=False, progress=lambda m: None)
    elapsed = time.perf_counter() - t0
    c = hw.cpu
    print(f"\nquick profile in {elapsed:.2f} s (kit cached): dram {c.dram_gbs} GB/s, GEMV {c.host_read_gbs} GB/s, "
          f"L3 {c.l3_gbs} GB/s, sgemm {c.fp32_gflops} GFLOP/s, {c.cores} cores, L3 {c.l3_bytes >> 20} MiB; "
          + ", ".join(f"{r.weight_type} x{r.rows} {r.gbs}" for r in c.gemv_reads))
    assert elapsed < 15.0                                                   # a second profile compiles nothing
    assert c.dram_gbs > 0.5 and c.host_read_gbs > 0.5 and c.fp32_gflops > 0.5 and c.l3_gbs > 0.5
    assert tuple(r.weight_type for r in c.gemv_reads if r.rows == 1) == WEIGHT_TYPES
    assert tuple(r.weight_type for r in c.gemv_reads if r.rows == 8) == WEIGHT_TYPES     # a batched step's GEMVs
    assert c.host_read_gbs == c.read_gbs("float16") == c.stream_gbs
    eight = next(r.gbs for r in c.gemv_reads if r.weight_type == "float16" and r.rows == 8)
    assert c.read_gbs("float16", 8) == min(c.host_read_gbs, eight)                     # 8 rows: what 8 rows read
    assert c.cores >= 1 and c.threads >= c.cores
    assert 0 < c.ram_free_bytes <= c.ram_total_bytes
    assert hw.gpu is None and hw.link is None and hw.block_overhead_ms == 0.0
    assert c.block_overhead_ms is None                                      # overheads=False: not measured
    assert any(u.startswith("gpu, link: HELMC_GPU_BACKEND=none") for u in hw.unmeasured)
    assert any("quick mode" in n for n in hw.notes) and any("decode GEMV reads" in n for n in hw.notes)
    assert any(n.startswith("cpu: fp32_gflops") and "helmc's prefill GEMM" in n for n in hw.notes)
    path = tmp_path / "hardware.json"
    hw.save(str(path))
    assert HardwareProfile.load(str(path)) == hw
    assert [p.name for p in tmp_path.iterdir()] == ["hardware.json"]        # written by rename, no leftovers


def test_cpu_facts_from_linux_files():
    if not __import__("os").path.exists("/proc/meminfo"):
        pytest.skip("not Linux")
    total, avail, where = ram_bytes()
    assert 0 < avail <= total and where
    l3, instances = l3_total_bytes([0])
    assert (l3 > 0) == (instances > 0)
    assert _parse_size("32768K") == 32 * 2 ** 20 and _parse_size("2M") == 2 * 2 ** 20 and _parse_size("512") == 512


class NumpyDevice(mg.ArrayBackend):
    """Runs the GPU benchmarks' arithmetic on numpy arrays: checks the measurement code, not a GPU."""
    name = "numpy-stand-in"

    def __init__(self, fail=()):
        super().__init__(np)
        self.fail = fail

    def info(self):
        return mg.DeviceInfo("Stand-in GPU", 9, 0, 2 * mg.GIB, 4 * mg.GIB)

    def sync(self):
        pass

    def time_ms(self, fn, inner):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) * 1e3

    def matmul(self, a, b):
        if "matmul" in self.fail and a.shape[0] == TINY.matmul_m:
            raise RuntimeError("stand-in matmul failure")
        if "gemv" in self.fail and a.shape[0] == 1:
            raise RuntimeError("stand-in gemv failure")
        return a @ b

    def pinned(self, nbytes):
        if "link" in self.fail:
            raise RuntimeError("stand-in pinned failure")
        return np.zeros(nbytes, np.uint8)

    def h2d(self, dev, host, nbytes):
        dev[:nbytes] = host[:nbytes]

    def d2h(self, host, dev, nbytes):
        host[:nbytes] = dev[:nbytes]

    def release(self):
        pass


def test_gpu_benchmarks_arithmetic_on_a_stand_in():
    m = mg.run_gpu_benchmarks(NumpyDevice(), TINY)
    assert m.gpu.name == "Stand-in GPU" and m.gpu.arch == "sm_90"
    assert m.gpu.vram_free_bytes == 2 * mg.GIB and m.gpu.hbm_gbs > 0
    assert m.link.h2d_gbs > 0 and m.link.d2h_gbs > 0 and m.link.latency_us >= 0
    assert not m.link.has_concurrent and not m.unmeasured                   # the window is measure.py's step


def test_gpu_failures_are_listed_not_invented():
    m = mg.run_gpu_benchmarks(NumpyDevice(fail=("matmul",)), TINY)
    assert m.gpu.fp16_tflops == 0.0 and any(u.startswith("gpu.fp16_tflops: matmul benchmark failed") for u in m.unmeasured)
    m = mg.run_gpu_benchmarks(NumpyDevice(fail=("link",)), TINY)
    assert m.gpu is None and m.link is None and any("link benchmark failed" in u for u in m.unmeasured)
    m = mg.run_gpu_benchmarks(NumpyDevice(fail=("gemv",)), TINY)
    assert m.gpu is None and any("HBM benchmark failed" in u for u in m.unmeasured)


def test_torch_backend_code_on_the_cpu():
    torch = pytest.importorskip("torch")

    class TorchOnCpu(mg.TorchBackend):
        def info(self):
            return mg.DeviceInfo("torch-cpu stand-in", 8, 9, mg.GIB, 2 * mg.GIB)
    m = mg.run_gpu_benchmarks(TorchOnCpu(torch, device="cpu"), TINY)
    assert m.gpu is not None and m.gpu.arch == "sm_89" and m.link.h2d_gbs > 0
    assert not [u for u in m.unmeasured if "failed" in u]


def test_backend_selection_without_a_gpu():
    be, why = mg.open_backend("none")
    assert be is None and "none" in why
    be, why = mg.open_backend("opencl")
    assert be is None and "expected cupy, torch or none" in why


@pytest.mark.gpu
def test_real_gpu_profile():
    """The whole profile on a GPU machine, with the kit in HELMC_PROFILE_KIT (built elsewhere for this machine by
    `helmc profile --build-kit DIR --for hardware.json`; benchmarks/bench_profile_plans.py reports the plans it gives)."""
    import os
    cupy = cuda_device()
    kit = os.environ.get("HELMC_PROFILE_KIT")
    if not kit:
        pytest.skip("HELMC_PROFILE_KIT names no profile kit for this machine")
    from helmc.api import profile
    hw = profile(quick=True, gpu_backend="cupy", kit_dir=kit, progress=print)
    print("\n" + hw.to_json())
    assert hw.gpu is not None and hw.gpu.arch.startswith("sm_")
    assert hw.gpu.hbm_gbs > 100 and hw.gpu.fp16_tflops > 1
    assert hw.link.h2d_gbs > 1 and hw.link.d2h_gbs > 1 and 0 < hw.link.latency_us < 1000
    assert hw.link.has_concurrent and 0 < hw.link.h2d_concurrent_gbs <= 1.2 * hw.link.h2d_gbs
    assert hw.gpu.block_overhead_ms is not None and hw.cpu.block_overhead_ms is not None
    # helmc's own GPU decode GEMVs, every type the kit has (a kit built for this GPU's arch)
    assert {r.weight_type for r in hw.gpu.gemv_reads} == set(WEIGHT_TYPES)
    assert all(0.2 * hw.gpu.hbm_gbs < r.gbs < 1.5 * hw.gpu.hbm_gbs for r in hw.gpu.gemv_reads), hw.gpu.gemv_reads
    # the runtime's VRAM beyond a plan, measured in a fresh process (a CUDA context alone is ~0.3-0.5 GiB)
    reserve = [n for n in hw.notes if n.startswith("gpu reserve:")]
    assert reserve and 64 << 20 < hw.gpu_reserve_bytes < 4 << 30 and hw.gpu_reserve_bytes != 10 ** 9, reserve


def test_format_2_fields_and_their_refusals():
    import dataclasses
    import json
    from helmc.errors import HelmcError
    from helmc.hardware.profile import KernelRead, LinkProfile, load_hardware
    hw = load_hardware("h100-sxm-measured")
    raw = json.loads(hw.to_json())
    raw["format_version"] = 1
    with pytest.raises(HelmcError, match=r"format_version expected 2, found 1 \(a profile of an older helmc: run "
                                         r"`helmc profile` again\)"):
        HardwareProfile.from_json(json.dumps(raw))
    raw["format_version"] = 2
    raw["cpu"]["dram_strided_gbs"] = 142.79                      # format 1's field is gone, not silently ignored
    with pytest.raises(HelmcError, match=r"unknown key\(s\) \['dram_strided_gbs'\]"):
        HardwareProfile.from_json(json.dumps(raw))
    # The preset kept format 1's inference-like figure as its M, so its plans are what they were.
    assert hw.cpu.host_read_gbs == hw.cpu.stream_gbs == 142.79 and not hw.link.has_concurrent
    with pytest.raises(HelmcError, match="expected both > 0 \\(measured together\\) or both 0, found 40.0, 0.0"):
        LinkProfile(54.0, 54.0, 8.0, h2d_concurrent_gbs=40.0)
    with pytest.raises(HelmcError, match="one entry per weight type"):
        dataclasses.replace(hw.cpu, gemv_reads=(KernelRead("q4_k", 30.0), KernelRead("q4_k", 31.0)))
    cpu = dataclasses.replace(hw.cpu, host_read_gbs=92.0, gemv_reads=(KernelRead("float16", 92.0), KernelRead("q4_k", 37.0)))
    assert cpu.read_gbs("q4_k") == 37.0 and cpu.read_gbs("q6_k") == 92.0        # unmeasured type: the fp16 figure
    link = LinkProfile(54.0, 54.0, 8.0, h2d_concurrent_gbs=40.0, cpu_read_concurrent_gbs=80.0)
    assert link.has_concurrent and link.combined_gbs == 120.0
    again = dataclasses.replace(hw, cpu=cpu, link=link)
    assert HardwareProfile.from_json(again.to_json()) == again
    # A doubtful figure is kept with what it stayed below, and printed as a warning; a profile from before the
    # field (the preset) loads with none.
    from helmc.cli.profile_plan import summarize_profile
    assert hw.doubtful == () and "warning" not in summarize_profile(hw)
    why = "cpu.dram_gbs (helmc's stream read) 11.7 GB/s stayed below 0.75 x 89.3 GB/s"
    doubted = dataclasses.replace(again, doubtful=(why,))
    assert HardwareProfile.from_json(doubted.to_json()) == doubted
    assert f"warning: doubtful figure: {why}" in summarize_profile(doubted).splitlines()
