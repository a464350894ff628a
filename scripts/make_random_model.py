#!/usr/bin/env python3
"""Write a Hugging Face model directory with a real Qwen3 configuration and random weights, fast.

    python scripts/make_random_model.py OUT_DIR --config qwen3-8b [--dtype float16] [--seed 0]
    python scripts/make_random_model.py OUT_DIR --config qwen3-8b --config-only   (for `helmc build` here)

Configs: qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b (the published shapes), tiny (for CPU tests).
Writes sharded safetensors + model.safetensors.index.json, config.json (Qwen3ForCausalLM),
generation_config.json, and a small byte-level BPE tokenizer.json trained here on a built-in text
(its vocabulary is smaller than the model's: ids beyond it exist only as model outputs).

Weights: N(0, std) (default 0.02, so activations stay well inside fp16 range), RMSNorm weights
1 + N(0, 0.02). On a GPU each tensor is drawn on the device (an 8B model's draws take well under a
second; the run is bound by writing 16 GB). Without a GPU one pool of random numbers per shape is
drawn once and each layer takes it rolled by a layer-dependent offset, because drawing 8B normals
on the CPU took 257 s on the GPU machine. Safetensors are written tensor by tensor (never a whole
shard in memory) into OUT_DIR.partial, renamed to OUT_DIR at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time

CONFIGS = {
    #            hidden inter  layers heads kv  head_dim tie
    "qwen3-4b": (2560, 9728, 36, 32, 8, 128, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, 128, False),
    "qwen3-32b": (5120, 25600, 64, 64, 8, 128, False),
    "tiny": (64, 128, 2, 4, 2, 16, False),
}
VOCAB = {"tiny": 512}
DEFAULT_VOCAB = 151936
SAFETENSORS_DTYPE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2 in the tokenizer

TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. A model larger than the GPU budget runs with its first
layers on the CPU and the rest on the GPU, one activation crossing PCIe per step. Ahead-of-time
compilation turns each block into machine code for the processor it will run on. Numbers: 0 1 2 3 4
5 6 7 8 9 10 100 1000. def main(): return sum(x * x for x in range(10))  # Python, too.
Once upon a time there was a small model that generated random tokens, quickly and correctly.
"""


def hf_config(name: str, dtype: str) -> dict:
    H, I, L, heads, kv, hd, tie = CONFIGS[name]
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": VOCAB.get(name, DEFAULT_VOCAB), "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": tie, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": L, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 0, "eos_token_id": 2, "dtype": dtype,
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(HF name, shape, is_norm) in checkpoint order."""
    H, I, V, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    Q, KV = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (V, H), False)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), True),
                (p + "self_attn.q_proj.weight", (Q, H), False), (p + "self_attn.k_proj.weight", (KV, H), False),
                (p + "self_attn.v_proj.weight", (KV, H), False), (p + "self_attn.o_proj.weight", (H, Q), False),
                (p + "self_attn.q_norm.weight", (hd,), True), (p + "self_attn.k_norm.weight", (hd,), True),
                (p + "post_attention_layernorm.weight", (H,), True),
                (p + "mlp.gate_proj.weight", (I, H), False), (p + "mlp.up_proj.weight", (I, H), False),
                (p + "mlp.down_proj.weight", (H, I), False)]
    out.append(("model.norm.weight", (H,), True))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, H), False))
    return out


class RandomSource:
    """Draws each tensor on the GPU, or on the CPU rolls one pool per shape (see module docstring)."""

    def __init__(self, device: str, dtype, std: float, seed: int):
        import torch

        self.torch, self.device, self.dtype, self.std = torch, device, dtype, std
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.pools: dict[tuple[int, ...], object] = {}
        self.count = 0

    def draw(self, shape: tuple[int, ...], is_norm: bool):
        torch = self.torch
        self.count += 1
        if self.device != "cpu":
            t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
            t = t.mul_(self.std).add_(1.0 if is_norm else 0.0)
            return t.to(self.dtype)
        key = (shape, is_norm)
        if key not in self.pools:
            base = torch.randn(shape, generator=self.gen, dtype=torch.float32) * self.std
            self.pools[key] = (base + (1.0 if is_norm else 0.0)).to(self.dtype).reshape(-1)
        pool = self.pools[key]
        return torch.roll(pool, shifts=(self.count * 7919) % pool.numel()).reshape(shape)  # [n] -> shape


def _header(entries: list[tuple[str, tuple[int, ...], int]], dtype_tag: str) -> bytes:
    header, offset = {}, 0
    for name, shape, nbytes in entries:
        header[name] = {"dtype": dtype_tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * ((8 - len(raw) % 8) % 8)          # data must start 8-byte aligned


def write_shards(out_dir: str, cfg: dict, dtype: str, src: RandomSource, shard_bytes: int) -> dict:
    """Plan shards by size, then stream each tensor device -> host -> file."""
    import numpy as np

    itemsize = 2 if dtype in ("float16", "bfloat16") else 4
    plan, cur, cur_bytes = [], [], 0
    for name, shape, is_norm in tensor_shapes(cfg):
        nbytes = int(np.prod(shape)) * itemsize
        if cur and cur_bytes + nbytes > shard_bytes:
            plan.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, is_norm, nbytes))
        cur_bytes += nbytes
    plan.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(plan):
        fname = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        header = _header([(n, s, b) for n, s, _, b in shard], SAFETENSORS_DTYPE[dtype])
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for name, shape, is_norm, nbytes in shard:
                t = src.draw(shape, is_norm)
                host = t.contiguous().cpu()
                # the tensor's bytes as stored (bf16 has no numpy dtype: view as int16 first), no extra copy
                host.view(src.torch.int16 if itemsize == 2 else src.torch.int32).numpy().tofile(f)
                weight_map[name] = fname
                total += nbytes
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 400), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
                   "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
                   "model_max_length": 40960}, f, indent=2)


def make_random_model(out_dir: str, config: str, dtype: str = "float16", seed: int = 0, std: float = 0.02,
                      device: str = "auto", shard_gib: float = 4.0, force: bool = False,
                      config_only: bool = False) -> dict:
    import torch

    if config not in CONFIGS:
        raise SystemExit(f"--config: expected one of {sorted(CONFIGS)}, found {config!r}")
    if dtype not in SAFETENSORS_DTYPE:
        raise SystemExit(f"--dtype: expected one of {sorted(SAFETENSORS_DTYPE)}, found {dtype!r}")
    if os.path.exists(out_dir) and not force:
        raise SystemExit(f"{out_dir} exists; pass --force to replace it")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = hf_config(config, dtype)
    partial = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    t0 = time.time()
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    if not config_only:
        src = RandomSource(device, getattr(torch, dtype), std, seed)
        index = write_shards(partial, cfg, dtype, src, int(shard_gib * (1 << 30)))
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(partial, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 2, "do_sample": False}, f, indent=2)
    write_tokenizer(partial, cfg["vocab_size"])
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(partial, out_dir)
    secs = time.time() - t0
    size = index["metadata"]["total_size"]
    print(f"{out_dir}: {config} {dtype}, {size / 1e9:.2f} GB in {len(set(index['weight_map'].values()))} shards, "
          f"random on {device}, {secs:.1f} s ({size / 1e9 / max(secs, 1e-9):.2f} GB/s)")
    return {"dir": out_dir, "bytes": size, "seconds": secs, "device": device}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--dtype", default="float16", choices=sorted(SAFETENSORS_DTYPE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    ap.add_argument("--config-only", action="store_true",
                    help="config.json + tokenizer only (what `helmc build` needs on a CPU machine), no weights")
    a = ap.parse_args(argv)
    make_random_model(a.out_dir, a.config, a.dtype, a.seed, a.std, a.device, a.shard_gib, a.force, a.config_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
