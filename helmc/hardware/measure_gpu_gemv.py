"""M on the GPU per weight type: helmc's own decode GEMVs of one block, timed as the GPU stage launches them.

The cupy matmul that gives gpu.hbm_gbs reads fp16 at ~2.9 TB/s on an H100; helmc's int8-activation Q4_K GEMVs read
~1.5-2.2 TB/s (their short-row launches carry a fixed part), so an all-GPU Q4_K plan predicted 2.83 ms a token where
3.46 ran. Here each weight type's kernels from the profile kit (ProfileKit.gpu_gemv_kernels,
compiled by `helmc profile --build-kit` for the GPU's arch) run one block's launches in order -- q/k/v, o, gate/up
with SwiGLU, down with the residual add for fp16 / bf16 / the int8-activation block types (weight_types'
gpu_gemv_int8); one per linear for the other block types -- over
weight sets rotated so that every call reads HBM (sets spanning > ROTATE_BYTES, beyond any L2), and the block's
weight bytes over its median time is that type's rate. Runtime-only TVM and CuPy: what the GPU machine has.
Weights are random bytes (a kernel's time does not depend on the values it reads); nothing is compared here.
"""
from __future__ import annotations

import os
import statistics

from helmc.hardware.host_read import weight_bytes
from helmc.hardware.kit import FLOAT_TYPES, GPU_GEMV_DIR, GPU_GEMV_NAME, ProfileKit
from helmc.hardware.profile import KernelRead

ROTATE_BYTES = 512 << 20      # weight sets per type span at least this (H100 / H200 L2: 50 / 60 MB)
CALLS, TRIALS = 20, 3


def _weight(cp, shape: tuple[int, int], dtype: str):
    """A random weight as the GPU stage binds it (host_read.weight_bytes' shape and dtype): fp16 / bf16 [n, k] (bf16
    as its uint16 bits), or raw GGUF rows uint8 [n, row bytes]."""
    if dtype in FLOAT_TYPES:                                                   # finite fp16 and bf16 bit patterns
        bits = cp.random.randint(0, 1 << 14, shape, dtype=cp.uint16)
        return bits.view(cp.float16) if dtype == "float16" else bits
    return cp.random.randint(0, 256, shape, dtype=cp.uint8)


def _launches(cp, to_tvm, kit: ProfileKit, mod, weight_type: str):
    """(one block's launches as a function of the weight set, [weight sets], block weight bytes)."""
    lin = kit.block.linear_shapes()
    H, I, Q = kit.block.hidden, kit.block.ffn, kit.block.q_dim
    roles = kit.gpu_gemv_roles(weight_type)
    tv = (lambda a: to_tvm(a, "bfloat16")) if weight_type == "bfloat16" else (lambda a: to_tvm(a))   # noqa: E731
    stored = weight_bytes(kit, weight_type)                                      # role -> ((rows, cols), dtype)
    block_bytes = block_weight_bytes(kit, weight_type)
    sets = max(2, -(-ROTATE_BYTES // block_bytes))
    weights = [{name: tv(_weight(cp, shape, dtype)) for name, (shape, dtype) in stored.items()} for _ in range(sets)]
    x = {k: to_tvm(cp.full((1, k), 0.01, cp.float16)) for k in (H, Q, I)}       # [1, k] activations
    y = {n: to_tvm(cp.empty((1, n), cp.float16)) for n in {n for n, _ in lin.values()}}
    r = to_tvm(cp.zeros((1, H), cp.float16))                                      # the residual stream
    out = {name: to_tvm(cp.empty((1, n), cp.float16)) for name, (n, _) in lin.items()}
    f = {role: mod[name] for role, name in roles.items()}

    if "qkv" in roles:
        def block(w):
            f["qkv"](x[H], w["q"], w["k"], w["v"], out["q"], out["k"], out["v"])
            f["o"](x[Q], w["o"], y[H])
            f["swiglu"](x[H], w["gate"], w["up"], y[I])
            f["down"](x[I], w["down"], r, out["down"])
    else:
        def block(w):
            for name, (n, k) in lin.items():
                f[name](x[k], w[name], out[name])
    return block, weights, block_bytes


def measure_gpu_gemv_reads(kit_dir: str, kit: ProfileKit, cp) -> tuple[tuple[KernelRead, ...], tuple[str, ...]]:
    """(KernelRead per weight type the kit's GPU GEMVs cover, notes)."""
    from helmc.runtime.cuda_runtime import cupy_to_tvm, load_gpu_executable

    d = os.path.join(kit_dir, GPU_GEMV_DIR)
    mod = load_gpu_executable(os.path.join(d, GPU_GEMV_NAME + ".so"), os.path.join(d, GPU_GEMV_NAME + ".cubins.json"))
    reads, notes = [], []
    for t in dict.fromkeys(k.weight_type for k in kit.gpu_gemv_kernels):
        block, weights, nbytes = _launches(cp, cupy_to_tvm, kit, mod, t)
        for w in weights:                                                    # warm-up: module load, first launches
            block(w)
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(TRIALS):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for i in range(CALLS):
                block(weights[i % len(weights)])
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / CALLS)       # ms per block
        ms = statistics.median(times)
        reads.append(KernelRead(t, round(nbytes / (ms * 1e-3) / 1e9, 1)))
        notes.append(f"gpu: {t} decode GEMVs of one {kit.block.hidden}x{kit.block.ffn} block {ms * 1e3:.1f} us, "
                     f"{reads[-1].gbs:.0f} GB/s ({len(weights)} weight sets of {nbytes / (1 << 20):.0f} MiB rotated)")
        del weights
        cp.get_default_memory_pool().free_all_blocks()
    return tuple(reads), tuple(notes)


def block_weight_bytes(kit: ProfileKit, weight_type: str) -> int:
    """Bytes of one block's linear weights in `weight_type` (what a block's GEMVs read)."""
    return sum(rows * cols * (2 if dtype in FLOAT_TYPES else 1)
               for (rows, cols), dtype in weight_bytes(kit, weight_type).values())

