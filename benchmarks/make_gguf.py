"""Random-weight GGUF files of real shapes, stored as llama.cpp's quantized files are (per-tensor type mixes).

    python -m benchmarks.make_gguf OUT.gguf --config qwen3-8b --mix q5_k_m [--seed 0] [--layers N] [--vocab V]
    python -m benchmarks.make_gguf OUT.gguf --config gemma3-12b --mix q4_k_m
    python -m benchmarks.make_gguf OUT.gguf --config qwen3-30b-a3b --mix q4_k_m
    python -m benchmarks.make_gguf OUT.gguf --config gpt-oss-20b --mix mxfp4_moe

A speed comparison needs the bytes of a real file, not its values: each tensor's type is what llama.cpp's
`llama-quantize` picks for that mix (helmc.model.weight_types.QuantMix, which follows llama-quant.cpp), and each
block holds random quants under a scale chosen so that the dequantized weights have a standard deviation of about
0.02 and mean about 0 (activations stay finite through every block). A mixture of experts (`qwen3moe`, as
llama.cpp's converter writes Qwen3-MoE) has each block's experts stacked per kind ([experts, rows, cols], typed as
the dense weight of the same kind), an F32 router of Gaussian weights at ROUTER_STD and q/k norms at QK_NORM_GAIN:
zero-mean weights and nearly one-hot attention keep the hidden states of different tokens apart, so the tokens of a
prompt spread over the experts as a trained router's do, where blocks of random quants under positive scales (a
large common mean in every row) route nearly every token to the same few experts. The same seed writes the same
bytes on any machine (NumPy's PCG64 through SeedSequence, one stream per tensor), so the file can be made where it
is used rather than carried. gpt-oss (`gpt-oss`, as llama.cpp's converter writes it) adds the biases of q/k/v/o, the
router and each expert stack (F32, Gaussian at BIAS_STD), the attention sinks (F32, Gaussian at SINK_STD), YaRN's keys
and the MLP's norm as post_attention_norm; its one mix is llama.cpp's MXFP4_MOE (experts MXFP4, every other matrix
Q8_0, the output too). Blocks are drawn in bulk on every core (one NumPy buffer per tensor, the scale fields
written into it as a column; the next tensor drawn while this one is written) and streamed to the file, so memory
stays at two tensors and the time is the disk's. This module needs NumPy, the `gguf` package and helmc's weight-type
table (standard library only): the GPU machine, which has no torch, runs it.
The vocabulary is a dummy byte-pair list (ids only); prompts are given as token ids.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

WEIGHT_STD = 0.02
# A mixture of experts' router and attention, by measurement (benchmarks/moe_routing_spread.py, a 256-token random
# prompt through a 16-block file; benchmarks/README.md): router weights at 0.044 give logits of std ~2 over the 128
# experts (the routing input has unit RMS), whose softmax puts ~0.62 of the mass on the top 8 and ~0.24 on the first
# (0.02: ~0.25 and ~0.05, nearly flat). With q/k norms of 1, random attention is diffuse (logits of std ~1), so a
# late token's attention output is about the mean over its prefix, alike for every token: block by block the hidden
# states converge, and from the fourth block on the prompt ran only 21-40 of the 128 experts. Norm weights of 3 make
# attention nearly one-hot, as trained attention mostly is: 120-128 experts in every block, the hottest 16 taking
# 0.20-0.46 of the selections (2: down to ~50 experts by block 48 in a NumPy model of the same shapes).
ROUTER_STD = 0.044
QK_NORM_GAIN = 3.0
# gpt-oss's biases and sinks: small beside the weights' products (a random row's dot product with a unit-RMS input
# has a std of ~WEIGHT_STD * sqrt(hidden) ~ 1), sinks of the order of trained ones (a few nats either way).
BIAS_STD = 0.02
SINK_STD = 1.0
# MXFP4's block scale is an E8M0 exponent byte, not an fp16 field: w = kvalues[q] * 2^(e - 128) with kvalues the
# doubled E2M1 magnitudes (std ~5.85 over random nibbles), so e = 120 gives a std of ~0.023, about WEIGHT_STD.
MXFP4_EXPONENT = 120
# llama.cpp's MXFP4_MOE file type (llama-quant.cpp): stacked experts MXFP4, every other matrix (the output too) Q8_0.
MXFP4_MOE = "mxfp4_moe"
MXFP4_MOE_FILE_TYPE = 38
CHUNK_BYTES = 1 << 25        # random bytes drawn per task: 32 MiB, one stream each
SCALE_STREAM = 2**32 - 1     # the stream of a tensor's block scales (its byte chunks are numbered from 0)


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape as its GGUF metadata says it (the published config.json's values)."""
    arch: str                    # GGUF general.architecture
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_base: float
    tied: bool                   # no output.weight: the head reads token_embd (llama.cpp then types it as the head)
    rms_eps: float = 1e-6
    sliding_window: int = 0      # gemma3: every sliding_pattern-th block global, the others windowed
    # The published config's sliding_window_pattern and rope_local_base_freq: llama.cpp's gemma3 files carry neither
    # (its loader fixes them at 6 and 10000), so neither is written; the file is what a reader meets.
    sliding_pattern: int = 0
    rope_base_swa: float = 0.0
    rope_linear_factor: float = 0.0
    post_norms: bool = False     # gemma3's post-attention and post-FFN norms
    # A mixture of experts (every block routed): expert_count, expert_used_count, expert_feed_forward_length; `ffn`
    # is then config.json's intermediate_size, which the converter writes as feed_forward_length all the same.
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    router_std: float = ROUTER_STD
    qk_norm_gain: float = 1.0    # the weights of attn_q_norm and attn_k_norm (every other norm's are 1)
    qk_norms: bool = True        # attn_q_norm / attn_k_norm (qwen3, gemma3); gpt-oss has none
    ffn_norm: str = "ffn_norm"   # the MLP's norm: gpt-oss's converter names it post_attention_norm
    # gpt-oss: biases on q/k/v/o, the router and the experts; a sink logit per head; YaRN (factor, original context)
    biases: bool = False
    sinks: bool = False
    yarn_factor: float = 0.0
    yarn_original_context: int = 0


CONFIGS: dict[str, ModelShape] = {
    # Qwen/Qwen3-8B config.json
    "qwen3-8b": ModelShape("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 40960, 1e6, tied=False),
    # google/gemma-3-12b-it text_config (the GGUF's 262144 tokens: the converter trims the embedding's padding rows)
    "gemma3-12b": ModelShape("gemma3", 3840, 15360, 48, 16, 8, 256, 262144, 131072, 1e6, tied=True,
                             sliding_window=1024, sliding_pattern=6, rope_base_swa=1e4, rope_linear_factor=8.0,
                             post_norms=True),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, top-8 (norm_topk_prob, which llama.cpp always applies)
    "qwen3-30b-a3b": ModelShape("qwen3moe", 2048, 6144, 48, 32, 4, 128, 151936, 40960, 1e6, tied=False,
                                experts=128, experts_used=8, expert_ffn=768, qk_norm_gain=QK_NORM_GAIN),
    # openai/gpt-oss-20b config.json: 32 experts of 2880, top-4; every other block a window of 128 (llama.cpp's
    # loader fixes the pattern at 2); YaRN x32 over 4096
    "gpt-oss-20b": ModelShape("gpt-oss", 2880, 2880, 24, 64, 8, 64, 201088, 131072, 150000.0, tied=False,
                              rms_eps=1e-5, sliding_window=128, experts=32, experts_used=4, expert_ffn=2880,
                              qk_norms=False, ffn_norm="post_attention_norm", biases=True, sinks=True, yarn_factor=32.0, yarn_original_context=4096),
}

# Where each block format keeps its fp16 scale d (and dmin, with its ratio to d that centres the weights on 0: the
# K-quants' w = d * sc * q - dmin * m, sc and m drawn alike, q's mean 7.5 (Q4_K) or 15.5 (Q5_K)). Every other byte of
# a block is an integer field, so random bytes there are valid quants, sub-scales and high bits.
SCALE_FIELDS: dict[str, tuple[int, int | None, float]] = {
    "q8_0": (0, None, 0.0), "q4_0": (0, None, 0.0), "q5_0": (0, None, 0.0), "iq4_xs": (0, None, 0.0),
    "q3_k": (108, None, 0.0), "q6_k": (208, None, 0.0), "q4_k": (0, 2, 7.5), "q5_k": (0, 2, 15.5),
}


def tensor_types(shape: ModelShape, mix_name: str) -> dict[str, str]:
    """{GGUF tensor name: helmc weight type} of every tensor, as llama-quantize types them for the mix; norms, a
    router, biases and sinks f32. A block's stacked experts take the type of the dense weight of their kind
    (llama-quant.cpp matches ffn_down_exps as ffn_down, by the block index in its name), the n_experts rules those
    of a model of that many; under MXFP4_MOE they are MXFP4 and every other matrix Q8_0."""
    from helmc.model.arch.tensors import DENSE_BLOCK
    from helmc.model.weight_types import quant_mix
    if mix_name == MXFP4_MOE:
        if not shape.experts:
            raise SystemExit(f"make_gguf --mix: {MXFP4_MOE} expected a mixture of experts, found {shape.arch}")
        type_of, head, embd = (lambda hf, layers, experts: "q8_0"), "q8_0", "q8_0"
    else:
        mix = quant_mix(mix_name, "make_gguf --mix")
        unknown = [t for t in mix.types if t not in SCALE_FIELDS]
        if unknown:
            raise SystemExit(f"make_gguf --mix: expected a mix of {', '.join(SCALE_FIELDS)}, found {mix_name!r} "
                             f"with {unknown}")
        type_of, head, embd = mix.type_of, mix.type_of("lm_head.weight", shape.layers), mix.linear_type
    hf_of = {g.removesuffix(".weight"): hf for hf, g in DENSE_BLOCK.items() if g.endswith(".weight")}
    ffn = ("ffn_gate", "ffn_up", "ffn_down")
    if shape.experts:
        ffn = tuple(f"{n}_exps" for n in ffn)
    attn = ("attn_q", "attn_k", "attn_v", "attn_output")
    f32s = ["attn_norm", shape.ffn_norm]
    f32s += ["attn_q_norm", "attn_k_norm"] if shape.qk_norms else []
    if shape.post_norms:
        f32s += ["post_attention_norm", "post_ffw_norm"]
    if shape.experts:
        f32s += ["ffn_gate_inp"]                 # the router: llama.cpp neither converts nor quantizes it from F32
    out = {"token_embd.weight": head if shape.tied else embd}
    for i in range(shape.layers):
        out |= {f"blk.{i}.{n}.weight": "f32" for n in f32s}
        for n in attn + ffn:
            hf = f"model.layers.{i}.{hf_of[n.removesuffix('_exps')]}"
            out[f"blk.{i}.{n}.weight"] = "mxfp4" if mix_name == MXFP4_MOE and n in ffn else \
                type_of(hf, shape.layers, shape.experts)
        if shape.sinks:
            out[f"blk.{i}.attn_sinks.weight"] = "f32"
        if shape.biases:
            out |= {f"blk.{i}.{n}.bias": "f32" for n in attn + ffn + ("ffn_gate_inp",)}
    out["output_norm.weight"] = "f32"
    if not shape.tied:
        out["output.weight"] = head
    return out


def tensor_shape(shape: ModelShape, name: str) -> tuple[int, ...]:
    """(rows, cols) of a matrix as NumPy sees it (GGUF lists them the other way round), (experts, rows, cols) of a
    stack of experts, (n,) of a norm or a sink vector; a bias is its matrix's shape without the columns."""
    s = shape
    q, kv, E, I = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts, s.expert_ffn
    role = name.split(".")[-2]
    dims = {"token_embd": (s.vocab, s.hidden), "output": (s.vocab, s.hidden), "attn_q": (q, s.hidden),
            "attn_k": (kv, s.hidden), "attn_v": (kv, s.hidden), "attn_output": (s.hidden, q),
            "ffn_gate": (s.ffn, s.hidden), "ffn_up": (s.ffn, s.hidden), "ffn_down": (s.hidden, s.ffn),
            "ffn_gate_inp": (E, s.hidden), "ffn_gate_exps": (E, I, s.hidden), "ffn_up_exps": (E, I, s.hidden),
            "ffn_down_exps": (E, s.hidden, I), "attn_sinks": (s.heads,),
            "attn_q_norm": (s.head_dim,), "attn_k_norm": (s.head_dim,)}.get(role, (s.hidden,))
    return dims[:-1] if name.endswith(".bias") else dims


def _scaled(raw: np.ndarray, qtype: str, d: np.ndarray) -> np.ndarray:
    """raw (uint8 [blocks, block bytes]) with its scale fields set to d (fp16) and dmin to d times the type's ratio;
    an MXFP4 block's exponent byte to MXFP4_EXPONENT (d unused: the type has no fractional scale)."""
    if qtype == "mxfp4":
        raw[:, 0] = MXFP4_EXPONENT
        return raw
    off, dmin_off, ratio = SCALE_FIELDS[qtype]
    raw[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if dmin_off is not None:
        raw[:, dmin_off:dmin_off + 2] = (d * ratio).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def _unit_std(qtype: str) -> float:
    """The standard deviation of a type's random blocks at d = 1, by gguf's own dequantization of 256 of them."""
    import gguf
    from helmc.model.weight_types import block_type
    t = block_type(qtype)
    rng = np.random.default_rng(12345)
    raw = _scaled(rng.integers(0, 256, (256, t.block_bytes), dtype=np.uint8), qtype, np.ones(256, np.float32))
    return float(gguf.dequantize(raw, gguf.GGMLQuantizationType(t.ggml_id)).std())


def random_bytes(key: tuple[int, ...], nbytes: int, pool: ThreadPoolExecutor) -> np.ndarray:
    """nbytes random bytes, drawn in CHUNK_BYTES pieces on the pool's threads (PCG64's random_raw releases the GIL),
    piece c from the stream (*key, c): the same bytes whatever the number of threads."""
    words = -(-nbytes // 8)
    out = np.empty(words, dtype=np.uint64)
    step = CHUNK_BYTES // 8

    def fill(c: int) -> None:
        lo = c * step
        out[lo:lo + step] = np.random.PCG64([*key, c]).random_raw(min(step, words - lo))
    list(pool.map(fill, range(-(-words // step))))
    return out.view(np.uint8)[:nbytes]


def random_blocks(key: tuple[int, ...], dims: tuple[int, ...], qtype: str, unit_std: float,
                  pool: ThreadPoolExecutor) -> np.ndarray:
    """uint8 [*dims[:-1], row bytes] of random blocks of qtype whose weights have a std of about WEIGHT_STD."""
    from helmc.model.weight_types import block_type
    t = block_type(qtype)
    n = int(np.prod(dims, dtype=np.int64)) // t.block_weights
    raw = random_bytes(key, n * t.block_bytes, pool).reshape(n, t.block_bytes)
    d = (WEIGHT_STD / unit_std) * np.random.default_rng([*key, SCALE_STREAM]).uniform(0.75, 1.25, n).astype(np.float32)
    return _scaled(raw, qtype, d).reshape(*dims[:-1], t.row_bytes(dims[-1]))


def f32_tensor(key: tuple[int, ...], name: str, dims: tuple[int, ...], shape: ModelShape) -> np.ndarray:
    """A norm's weights (ones, q's and k's the shape's gain), or Gaussian from the tensor's own stream: a router's
    at the shape's router_std, a bias at BIAS_STD, sinks at SINK_STD."""
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return np.full(dims, shape.qk_norm_gain, dtype=np.float32)
    std = shape.router_std if name.endswith("ffn_gate_inp.weight") else BIAS_STD if name.endswith(".bias") else \
        SINK_STD if name.endswith("attn_sinks.weight") else None
    if std is None:
        return np.ones(dims, dtype=np.float32)
    return np.random.Generator(np.random.PCG64([*key, SCALE_STREAM])).standard_normal(dims, dtype=np.float32) \
        * np.float32(std)


def write_metadata(w, shape: ModelShape, file_type: int, name: str) -> None:
    import gguf
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.experts:                            # Qwen2MoeModel's keys, in the converter's order
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.rope_linear_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(shape.rope_linear_factor)
    if shape.yarn_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(shape.yarn_original_context)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o" if shape.arch == "gpt-oss" else "qwen2")
    w.add_token_list([f"t{i}" for i in range(shape.vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * shape.vocab)
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def make_gguf(out: str, config: str, mix: str, seed: int = 0, **overrides) -> dict[str, str]:
    """Write the file; returns {tensor name: weight type}. overrides: ModelShape fields that differ from the
    config's (a smaller model of the same kind, for tests)."""
    import gguf
    from helmc.model.weight_types import quant_mix, weight_type
    if config not in CONFIGS:
        raise SystemExit(f"make_gguf --config: expected one of {', '.join(CONFIGS)}, found {config!r}")
    shape = replace(CONFIGS[config], **{k: v for k, v in overrides.items() if v is not None})
    types = tensor_types(shape, mix)
    unit = {t: _unit_std(t) if t != "mxfp4" else 1.0 for t in set(types.values()) if t != "f32"}
    w = gguf.GGUFWriter(out, shape.arch)
    file_type = MXFP4_MOE_FILE_TYPE if mix == MXFP4_MOE else quant_mix(mix).file_type
    write_metadata(w, shape, file_type, f"{config} {mix} (random weights, seed {seed})")
    for name, t in types.items():
        dims = tensor_shape(shape, name)
        n = int(np.prod(dims[:-1], dtype=np.int64))
        if t == "f32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * n * dims[-1])
        else:
            wt = weight_type(t)
            w.add_tensor_info(name, (*dims[:-1], wt.row_bytes(dims[-1])), np.dtype(np.uint8),
                              n * wt.row_bytes(dims[-1]), raw_dtype=gguf.GGMLQuantizationType(wt.ggml_id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    def data(index: int, name: str, t: str) -> np.ndarray:
        dims = tensor_shape(shape, name)
        if t == "f32":
            return f32_tensor((seed, index), name, dims, shape)
        return random_blocks((seed, index), dims, t, unit[t], pool)

    # The next tensor is drawn while this one is written.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool, ThreadPoolExecutor(1) as ahead:
        items = list(types.items())
        pending = ahead.submit(data, 0, *items[0])
        for index in range(len(items)):
            tensor = pending.result()
            if index + 1 < len(items):
                pending = ahead.submit(data, index + 1, *items[index + 1])
            w.write_tensor_data(tensor)
    w.close()
    return types


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--mix", required=True, help="llama.cpp's file type: q4_k_m, q5_k_m, q3_k_m, q4_k, q8_0, ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks than the config's (tests)")
    ap.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary than the config's (tests)")
    ap.add_argument("--router-std", type=float, default=None,
                    help=f"a mixture of experts' router weights' standard deviation (default {ROUTER_STD})")
    a = ap.parse_args(argv)
    from helmc.errors import HelmcError
    t = time.perf_counter()
    try:
        types = make_gguf(a.out, a.config, a.mix, a.seed, layers=a.layers, vocab=a.vocab, router_std=a.router_std)
    except HelmcError as e:
        print(f"make_gguf: {e}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for v in types.values():
        counts[v] = counts.get(v, 0) + 1
    print(f"wrote {a.out}: {a.config} {a.mix}, {len(types)} tensors {counts}, {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
