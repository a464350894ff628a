#!/usr/bin/env bash
# One command for the main job on a fresh machine: install, make a small random-weight Qwen3 model
# (with a tokenizer trained locally), profile this machine, build a bundle, generate text; then the same model
# quantized to Q4_K_M (helmc build --quant), built and run.
# On a machine without a GPU the plan is all-CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
work="${HELMC_DEMO_DIR:-$root/.work/demo}"
mkdir -p "$work"
echo "== making a small random-weight Qwen3 model in $work/model"
python "$root/scripts/make_tiny_model.py" "$work/model" --arch qwen3 --layers 4 --hidden 256 --head-dim 64
echo "== helmc profile"
helmc profile -o "$work/hardware.json"
echo "== helmc build"
helmc build "$work/model" "$work/hardware.json" -o "$work/bundle"
echo "== helmc run"
helmc run "$work/bundle" --prompt "The quick brown fox" --max-new-tokens 32
helmc run "$work/bundle" --prompt "Once upon a time" --max-new-tokens 32 --temperature 0.8 --top-p 0.9 --seed 1 --json
echo "== helmc build --quant q4_k_m: the same model in llama.cpp's block formats (quantized once, into the weights cache)"
helmc build "$work/model" "$work/hardware.json" -o "$work/bundle-q4km" --quant q4_k_m
helmc run "$work/bundle-q4km" --prompt "The quick brown fox" --max-new-tokens 32
