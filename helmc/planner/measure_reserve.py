"""The VRAM helmc's runtime holds beyond what a plan counts, measured on this machine.

A plan counts weights, KV pages, activations, the staging ring and the streamed prefill's buffers; the process
also holds the CUDA context, the loaded kernels, CuPy's and cuBLAS's handles and pools and the decode graphs.
A fixed 10^9 bytes kept back for them would be too much: Qwen3-8B's runs used ~0.52 GiB, and under a 7 GiB
budget the rest is most of a block the GPU could hold.

`helmc profile` loads the profile kit's all-GPU synthetic bundle (Qwen3-8B's block shape, so the same kernels)
in a fresh process, as `helmc run` would start, planned for a budget just above its needs so that the KV page
pool takes the rest of the budget; the child runs one request (a PROMPT_TOKENS prompt and NEW_TOKENS tokens)
while this process samples the device's used memory. Two figures:

    context  = used once the child's CUDA context, CuPy and cuBLAS are up, before any allocation of its own
    beyond   = peak used - (usable VRAM of its plan - the reserve that plan kept back)

and the profile's gpu_reserve_bytes = max(context, beyond) + max(MARGIN_BYTES, MARGIN_SHARE of it). Measured on
H200 hosts: context 529-592 MiB; beyond 343 MiB for the kit (its plan counts more than it allocates), where
real hybrid plans held, beyond their plans, the context - 13 MiB (Qwen3-8B fp16, 6 streamed groups), + 105 MiB
(8B Q4_K, 13 groups) and + 142 MiB (14B Q4_K, 10 groups; not yet traced: beside CuPy's pool and the context,
TVM-side memory 66 MiB above fp16's at load): the margin covers the largest of those.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from helmc.errors import HelmcError

PROMPT_TOKENS = 128
NEW_TOKENS = 16
HEADROOM_BYTES = 256 << 20          # the child's budget above its plan's needs: the KV page pool's share
MARGIN_BYTES = 160 << 20            # kept back beyond the measured overhead (see above: up to 142 MiB of plan error)
MARGIN_SHARE = 0.10
SAMPLE_S = 0.002
CHILD_TIMEOUT_S = 300


def reserve_with_margin(overhead_bytes: int) -> int:
    return int(overhead_bytes + max(MARGIN_BYTES, MARGIN_SHARE * overhead_bytes))


@dataclass(frozen=True)
class ReserveMeasurement:
    peak_used_bytes: int            # the device's used memory above its level before the child started
    planned_bytes: int              # what the child's plan allocates: its usable VRAM less the reserve it assumed
    context_bytes: int = 0          # used once the child's context, CuPy and cuBLAS were up

    def __post_init__(self):
        if self.peak_used_bytes < 0 or self.planned_bytes <= 0 or self.context_bytes < 0:
            raise HelmcError(f"gpu reserve: expected peak used >= 0, planned > 0 and context >= 0 bytes, found "
                             f"{self.peak_used_bytes}, {self.planned_bytes} and {self.context_bytes}")

    @property
    def beyond_plan_bytes(self) -> int:
        return max(0, self.peak_used_bytes - self.planned_bytes)

    @property
    def overhead_bytes(self) -> int:
        return max(self.context_bytes, self.beyond_plan_bytes)

    @property
    def reserve_bytes(self) -> int:
        return reserve_with_margin(self.overhead_bytes)

    def note(self) -> str:
        gib = lambda n: f"{n / 2 ** 30:.3f} GiB"                           # noqa: E731
        return (f"gpu reserve: a fresh runtime process held {gib(self.context_bytes)} with its context, CuPy and "
                f"cuBLAS up, and with the kit's GPU stage {gib(self.peak_used_bytes)} at its peak, "
                f"{gib(self.beyond_plan_bytes)} above its plan's {gib(self.planned_bytes)}; reserve "
                f"{gib(self.reserve_bytes)} with the margin")


class _PeakSampler:
    """The device's used bytes above `base`, sampled in a thread until stop()."""

    def __init__(self, used, base: int):
        self.used, self.base, self.peak = used, base, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used() - self.base)
            time.sleep(SAMPLE_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used() - self.base)
        return self.peak


def device_used_bytes():
    """() -> the current device's used bytes (all processes), through CuPy."""
    import cupy
    rt = cupy.cuda.runtime

    def used() -> int:
        free, total = rt.memGetInfo()
        return int(total - free)
    return used


def measure_gpu_reserve(hw, bundle_dir: str, weights_dir: str, used=None, progress=lambda m: None) -> ReserveMeasurement:
    """Run the child (this module's main) on `bundle_dir` (an all-GPU bundle) with `weights_dir`, planned from `hw`,
    sampling `used()` (default device_used_bytes()) from before it starts until it has run its request."""
    used = used or device_used_bytes()
    with tempfile.TemporaryDirectory(prefix="helmc-gpu-reserve-") as tmp:
        hw_path = os.path.join(tmp, "hardware.json")
        hw.save(hw_path)
        base = used()
        sampler = _PeakSampler(used, base)
        env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
        log_path = os.path.join(tmp, "child.log")
        with open(log_path, "w") as log:       # a file, not a pipe: a child that writes much to stderr never blocks
            child = subprocess.Popen([sys.executable, "-m", "helmc.planner.measure_reserve", bundle_dir, weights_dir,
                                      hw_path, str(base)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            line = _read_result(child, log_path)
        finally:
            peak = sampler.stop()
            if child.poll() is None:
                try:
                    child.stdin.write("\n")
                    child.stdin.flush()
                except OSError:
                    pass
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    m = ReserveMeasurement(peak_used_bytes=peak, planned_bytes=int(line["planned_bytes"]),
                           context_bytes=int(line["context_bytes"]))
    progress(m.note())
    return m


def profile_gpu_reserve(hw, kit_dir: str, progress=lambda m: None):
    """hw with gpu_reserve_bytes measured on the kit's all-GPU bundle (synthetic weights for all its blocks), said in
    its notes; unchanged, and said in `unmeasured`, where there is no GPU or the kit has no GPU stage for it."""
    import dataclasses

    from helmc.hardware.kit import ProfileKit, write_synthetic_weights
    if hw.gpu is None:
        return hw
    kit = ProfileKit.load(kit_dir)
    if not kit.gpu_bundle or kit.gpu_arch != hw.gpu.arch:
        return dataclasses.replace(hw, unmeasured=hw.unmeasured + (
            f"gpu_reserve_bytes: the kit has no GPU stage for {hw.gpu.arch} (found {kit.gpu_arch or 'none'}); "
            f"kept {hw.gpu_reserve_bytes} bytes",))
    with tempfile.TemporaryDirectory(prefix="helmc-reserve-weights-") as weights:
        progress(f"gpu reserve: the kit's GPU stage ({kit.synthetic_layers} blocks) in a fresh process, one request")
        write_synthetic_weights(weights, kit.block, kit.synthetic_layers)
        try:
            m = measure_gpu_reserve(hw, os.path.join(kit_dir, kit.gpu_bundle), weights, progress=progress)
        except HelmcError as e:            # the rest of the profile stands; the plan keeps the default reserve
            return dataclasses.replace(hw, unmeasured=hw.unmeasured + (
                f"gpu_reserve_bytes: {e}; kept {hw.gpu_reserve_bytes} bytes",))
    return dataclasses.replace(hw, gpu_reserve_bytes=m.reserve_bytes, notes=tuple(hw.notes) + (m.note(),))


def _read_result(child, log_path: str) -> dict:
    """The child's JSON line, waiting at most CHILD_TIMEOUT_S for it."""
    import selectors
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=left):
                break
            line = child.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)
    with open(log_path) as f:
        err = f.read().strip()
    tail = err.splitlines()[-1] if err else ("no output" if child.poll() is not None else
                                             f"no result in {CHILD_TIMEOUT_S} s")
    raise HelmcError(f"gpu reserve: expected the kit's GPU stage to run a request in a fresh process, found it "
                     f"ended without a result ({tail[:200]})")


def _child(bundle_dir: str, weights_dir: str, hw_path: str, base: str) -> None:
    """Bring up the CUDA context, CuPy and cuBLAS and take the device's used memory above `base` (the parent's
    figure before this process started); then plan the bundle for a budget just above its needs, load it, run one
    request, report both, and hold everything until the parent (which samples the device meanwhile) writes a line."""
    import cupy
    cupy.zeros(1)
    cupy.cuda.device.get_cublas_handle()
    context = device_used_bytes()() - int(base)
    from helmc.hardware.profile import load_hardware
    from helmc.planner.replan_bundle import replan_bundle
    from helmc.runtime.session import Session

    hw = load_hardware(hw_path)
    whole, _ = replan_bundle(bundle_dir, hw)
    budget = (whole.memory.gpu_bytes + HEADROOM_BYTES) / 2 ** 30
    plan, spec = replan_bundle(bundle_dir, hw, gpu_budget_gib=budget)
    session = Session.load(bundle_dir, weights_dir, plan=plan)
    ids = [3 + i % max(1, spec.vocab_size - 3) for i in range(PROMPT_TOKENS)]
    session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    planned = plan.memory.usable_vram_bytes - hw.gpu_reserve_bytes
    print(json.dumps({"planned_bytes": planned, "context_bytes": max(0, context)}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    _child(*sys.argv[1:5])
