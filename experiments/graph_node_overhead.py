#!/usr/bin/env python3
"""What one kernel node of a CUDA graph costs on this GPU, beyond its own work (issue 16).

The all-GPU decode step is one CUDA graph of ~580 kernels. Its wall time did not move when the kernels' own times
(Nsight Compute, one node at a time) fell by 0.45 ms, so this measures the floor a chain of nodes puts under a
step: N kernels captured in a chain on one stream (as DecodeGraph captures), replayed R times, per node:
- empty:    grid 1, block 32, no memory access;
- wide:     grid 132, block 128, each thread reads and writes one float (a small kernel spanning the SMs);
- smem:     as wide, with 16 KiB of static shared memory (as the int8 GEMV's activations).
Prints microseconds per node for each N. CuPy only (no TVM).

    python experiments/graph_node_overhead.py [--nodes 100,580] [--replays 50]
"""
from __future__ import annotations

import argparse

import cupy as cp

SOURCE = r"""
extern "C" __global__ void empty_k() {}
extern "C" __global__ void wide_k(float* a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    a[i] = a[i] * 0.5f + 1.0f;
}
extern "C" __global__ void smem_k(float* a) {
    __shared__ float s[4096];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = a[i];
    __syncthreads();
    a[i] = s[(threadIdx.x + 1) % blockDim.x] * 0.5f + 1.0f;
}
"""


def per_node_us(kernel, grid, block, args, nodes: int, replays: int) -> float:
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(nodes):
            kernel(grid, block, args)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / (replays * nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="100,580")
    ap.add_argument("--replays", type=int, default=50)
    a = ap.parse_args()
    mod = cp.RawModule(code=SOURCE)
    buf = cp.zeros(132 * 128, cp.float32)
    cases = {"empty": (mod.get_function("empty_k"), (1,), (32,), ()),
             "wide": (mod.get_function("wide_k"), (132,), (128,), (buf,)),
             "smem": (mod.get_function("smem_k"), (132,), (128,), (buf,))}
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: us per graph node (chain on one stream)")
    print("| kernel | " + " | ".join(f"N={n}" for n in a.nodes.split(",")) + " |")
    for name, (k, grid, block, args) in cases.items():
        row = [per_node_us(k, grid, block, args, int(n), a.replays) for n in a.nodes.split(",")]
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row) + " |")


if __name__ == "__main__":
    main()
