#!/usr/bin/env python3
"""Make a small random-weight Hugging Face model directory (real architecture, local tokenizer)."""
import argparse

from helmc.testing import make_tiny_model

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("out_dir")
p.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen2", "llama", "mistral"])
p.add_argument("--layers", type=int, default=4)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
make_tiny_model(a.out_dir, a.arch, num_layers=a.layers, head_dim=a.head_dim, dtype=a.dtype, seed=a.seed,
                hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_attention_heads=max(1, a.hidden // a.head_dim),
                num_key_value_heads=max(1, a.hidden // a.head_dim // 2))
print(f"wrote {a.out_dir}")
