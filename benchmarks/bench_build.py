#!/usr/bin/env python3
"""Build time and peak memory of `helmc build` for a Qwen3-8B configuration with no weights.

A build needs config.json only; this writes the real Qwen3-8B config into an empty directory,
profiles nothing (uses the host profile given, or a quick one), and runs `helmc build` in a child
process so its peak RSS can be read. Target: at most 5 minutes and 4 GB on 2 cores.
    python -m benchmarks.bench_build [--hardware hardware.json] [--json]
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "bos_token_id": 151643, "eos_token_id": 151645}

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--hardware", default=None)
p.add_argument("--json", action="store_true")
a = p.parse_args()
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "qwen3-8b")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(QWEN3_8B, f)
    hw = a.hardware
    if hw is None:
        hw = os.path.join(tmp, "hardware.json")
        subprocess.run([sys.executable, "-c", f"from helmc.api import profile; profile(quick=True, overheads=False).save({hw!r})"], check=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "helmc.cli.main", "build", model, hw, "-o", os.path.join(tmp, "bundle"), "--no-cache",
                        ], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        sys.exit(r.returncode)
result = {"model": "Qwen3-8B config (no weights)", "build_seconds": round(seconds, 1), "peak_rss_mb": round(peak_mb),
          "machine": f"{platform.node()} {os.cpu_count()} cores", "command": "python -m benchmarks.bench_build"}
print(json.dumps(result) if a.json else f"build {seconds:.1f} s, peak RSS {peak_mb:.0f} MB")
print(r.stderr, file=sys.stderr)
