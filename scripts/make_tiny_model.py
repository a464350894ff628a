#!/usr/bin/env python3
"""Make a small random-weight Hugging Face model directory (real architecture, local tokenizer) with a ChatML chat
template, so `helmc chat` runs on it as on an instruction-tuned model (its replies are random text)."""
import argparse
import json
import os

from tokenizers import Tokenizer

from helmc.testing import make_tiny_model

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def add_chat_template(out_dir: str) -> None:
    """ChatML's two markers as special tokens of the tokenizer, the template in tokenizer_config.json, and <|im_end|>
    among generation_config.json's EOS ids (a reply ends there, as Qwen's and others' do)."""
    path = os.path.join(out_dir, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(path)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}, f, indent=2)
    gen_path = os.path.join(out_dir, "generation_config.json")
    gen = {}
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    eos = gen.get("eos_token_id", 0)
    eos = list(eos) if isinstance(eos, list) else [eos]
    gen["eos_token_id"] = eos + [tok.token_to_id("<|im_end|>")]
    with open(gen_path, "w") as f:
        json.dump(gen, f, indent=2)


p = argparse.ArgumentParser(description=__doc__)
p.add_argument("out_dir")
p.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen2", "llama", "mistral"])
p.add_argument("--layers", type=int, default=4)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
p.add_argument("--seed", type=int, default=0)
p.add_argument("--no-chat-template", action="store_true", help="leave the chat template and its tokens out")
a = p.parse_args()
make_tiny_model(a.out_dir, a.arch, num_layers=a.layers, head_dim=a.head_dim, dtype=a.dtype, seed=a.seed,
                hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_attention_heads=max(1, a.hidden // a.head_dim),
                num_key_value_heads=max(1, a.hidden // a.head_dim // 2))
if not a.no_chat_template:
    add_chat_template(a.out_dir)
print(f"wrote {a.out_dir}")
