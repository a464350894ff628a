#!/usr/bin/env python3
"""GPU kernel launches of one decode step of a model's GPU stage, one launch per linear against the merged
launches (issue 16: q/k/v, gate/up + SwiGLU, down + residual add, q/k norm + RoPE one launch each; a CUDA graph
node costs ~1 us beside its work, experiments/graph_node_overhead.py).

Builds the GPU stage as `helmc build` does (export, import, quantize_functions, compile_gpu_stage's passes and
TVM's build; no nvcc, no GPU) twice, merge_launches off and on, and prints the launches of every decode function
(compile_gpu_stage.kernel_launches) and per one-sequence step: blocks x (pre_attn + post_attn) + head. The paged
attention's own kernels (outside TVM, unchanged) are not counted.

    python experiments/decode_launches.py MODEL      # a Hugging Face directory (config.json only) or a GGUF file
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    from helmc.compiler.passes.compile_gpu_stage import build_gpu_executable, kernel_launches
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.passes.quantize_functions import quantize_functions
    from helmc.model.load import load_spec
    from helmc.runtime.stage import block_function_name

    spec = load_spec(a.model)
    mod, weight_types = quantize_functions(import_functions(export_functions(spec, act_dtype="float16")), spec)
    counts = {}
    for fuse in (False, True):
        launches = kernel_launches(build_gpu_executable(mod, a.arch, weight_types=weight_types, merge_launches=fuse))
        decode = {f: ks for f, ks in launches.items() if "_decode" in f}
        print(f"\nmerge_launches={fuse}:")
        for f, ks in sorted(decode.items()):
            print(f"  {f:24s} {len(ks):2d}  {' '.join(ks)}")
        blocks = sum(len(decode[block_function_name(part, "decode", spec.signature_index(layer))])
                     for layer in range(spec.num_layers) for part in ("pre_attn", "post_attn"))
        counts[fuse] = (blocks, len(decode["head_decode"]))
    for fuse, (blocks, head) in counts.items():
        print(f"merge_launches={fuse}: {spec.num_layers} blocks {blocks} launches + head {head}: {blocks + head} per "
              "one-sequence step (paged attention's kernels not counted)")


if __name__ == "__main__":
    main()
