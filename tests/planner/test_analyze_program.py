"""Program analysis (thesis 4.1.1, eqs. 4.1-4.5, 4.9, 4.11, 4.12) against hand-derived figures.

The thesis's running example: Qwen3-8B, H=4096, h_a=32, h_kv=8, d_h=128, d_ff=12288, 2-byte
weights. The Relax-IR cross-check lives with the exporter's tests; here the shapes are checked
against transformers' own Qwen3 module (built on the meta device, no weights).
"""
import random

import pytest

from helmc.planner.analyze_program import StageLoad, analyze_program
from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from qwen3_configs import QWEN3, qwen3_spec

H, HA, HKV, DH, DFF, V = 4096, 32, 8, 128, 12288, 151936


@pytest.fixture(scope="module")
def q8():
    return analyze_program(qwen3_spec("Qwen3-8B"))


def test_units_are_embedding_blocks_head(q8):
    kinds = [u.kind for u in q8.units]
    assert kinds == ["embedding"] + ["block"] * 36 + ["head"]
    assert [u.index for u in q8.units] == list(range(38))
    assert q8.num_units == 38                      # "38 partition units total for Qwen3-8B"


def test_block_w_param_matches_eqs_4_1_to_4_3(q8):
    w_attn = (H * HA * DH + H * HKV * DH + H * HKV * DH + HA * DH * H) * 2     # eq. 4.1
    w_ffn = 3 * H * DFF * 2                                                    # eq. 4.2
    w_norm = (2 * H + 2 * DH) * 2       # the thesis's two RMSNorms, plus Qwen3's q_norm and k_norm
    block = q8.units[1]
    print(f"W_attn {w_attn / 1e6:.1f} MB, W_FFN {w_ffn / 1e6:.1f} MB, W_param {block.param_bytes / 1e6:.2f} MB")
    assert round(w_attn / 1e6, 1) == 83.9 and round(w_ffn / 1e6, 1) == 302.0     # the thesis's figures
    assert block.param_bytes == w_attn + w_ffn + w_norm
    assert abs(block.param_bytes / 1e6 - 386) < 0.5                             # eq. 4.3: ~386 MB per block
    assert all(u.param_bytes == block.param_bytes for u in q8.units[1:-1])


def test_w_act_is_8_kb_at_batch_1(q8):
    assert q8.units[5].w_act(batch=1) == 8192                                    # eq. 4.4
    assert q8.units[5].w_act(batch=4, tokens=128) == 4 * 128 * 8192
    assert q8.units[0].w_act() == 8192                                           # the embedding's output too
    assert q8.units[-1].w_act() == 0                                             # nothing follows the head


def test_w_kv_per_block(q8):
    # Eq. 4.5: 2 x 8 x 128 x 2 x c = 4096 c bytes. The thesis prints "4c bytes" and "16 KB at c = 4096";
    # its own product is 4096 c bytes, i.e. 16 MiB per block at c = 4096.
    block = q8.units[1]
    assert block.w_kv(context=1) == 4096
    assert block.w_kv(context=4096) == 16 * 2 ** 20
    assert block.w_kv(context=100, batch=3) == 3 * 100 * 4096                   # eq. 4.12 with B
    assert q8.units[0].w_kv(100) == 0 and q8.units[-1].w_kv(100) == 0


def test_flops_match_eqs_4_9_and_4_11(q8):
    n, B, c = 7, 3, 500
    stage = q8.stage(3, 3 + n)
    assert stage.blocks == n
    assert B * stage.block_flops_per_token == 2 * B * (2 * H * H + 2 * H * HKV * DH + 3 * H * DFF) * n   # eq. 4.9
    assert B * c * stage.attn_flops_per_context_token == 4 * B * HA * c * DH * n                        # eq. 4.11
    assert B * c * stage.kv_bytes_per_token == 2 * B * n * c * HKV * DH * 2                             # eq. 4.12


def test_embedding_and_head(q8):
    emb, head = q8.units[0], q8.units[-1]
    assert emb.param_bytes == 0 and emb.gather_bytes_per_token == H * 2      # B x H rows read per token
    assert emb.stored_bytes == V * H * 2                                     # but the whole table is held
    assert head.param_bytes == head.stored_bytes == (V * H + H) * 2          # lm_head streams V x H, + final norm
    assert head.proj_flops_per_token == 2 * H * V


def test_any_dtype_scales_bytes_not_flops():
    spec = qwen3_spec("Qwen3-8B")
    a16, a32 = analyze_program(spec), analyze_program(spec, "float32")
    for u16, u32 in zip(a16.units, a32.units):
        assert u32.param_bytes == 2 * u16.param_bytes and u32.stored_bytes == 2 * u16.stored_bytes
        assert u32.kv_bytes_per_token == 2 * u16.kv_bytes_per_token
        assert u32.proj_flops_per_token == u16.proj_flops_per_token
    with pytest.raises(HelmcError, match="dtype expected"):
        analyze_program(spec, "int4")


def test_tied_embedding_held_once_per_device():
    a = analyze_program(qwen3_spec("Qwen3-4B"))                              # tie_word_embeddings: true
    table = 151936 * 2560 * 2
    assert a.tied_bytes == table
    everything = a.stage(0, a.num_units)
    assert a.held_bytes(everything) == everything.stored_bytes - table        # both on one device: once
    assert a.held_bytes(a.stage(0, 1)) == table                               # embedding alone holds it
    assert a.held_bytes(a.stage(a.num_units - 1, a.num_units)) == table + 2560 * 2   # the head holds its own copy
    assert a.units[-1].param_bytes == table + 2560 * 2                        # and streams all of it per token
    untied = analyze_program(qwen3_spec("Qwen3-8B"))
    whole = untied.stage(0, untied.num_units)
    assert untied.held_bytes(whole) == whole.stored_bytes


def test_qkv_bias_counted():
    cfg = {**QWEN3["Qwen3-8B"], "architectures": ["Qwen2ForCausalLM"]}
    q2 = analyze_program(ModelSpec.from_hf_config(cfg))
    q3 = analyze_program(qwen3_spec("Qwen3-8B"))
    bias = (HA * DH + 2 * HKV * DH) * 2
    qk_norm = 2 * DH * 2
    assert q2.units[1].param_bytes == q3.units[1].param_bytes + bias - qk_norm


def test_prefix_sums_equal_direct_sums(q8):
    rng = random.Random(0)
    for _ in range(50):
        lo = rng.randrange(0, q8.num_units + 1)
        hi = rng.randrange(lo, q8.num_units + 1)
        direct = StageLoad()
        for u in q8.units[lo:hi]:
            direct = direct + StageLoad.of(u)
        assert q8.stage(lo, hi) == direct
    with pytest.raises(HelmcError, match="expected 0 <= lo <= hi"):
        q8.stage(5, 2)


def test_workspace_grows_with_tokens_and_counts_logits(q8):
    blocks = q8.stage(1, 37)
    head = q8.stage(37, 38)
    assert q8.workspace_bytes(blocks, 1, 128) > q8.workspace_bytes(blocks, 1, 1)
    assert q8.workspace_bytes(head, 1, 1) >= V * 4                           # fp32 logits of one position
    assert q8.workspace_bytes(StageLoad(), 1, 128) == 0


def test_shapes_match_transformers_qwen3_module():
    """Independent of ModelSpec.block_weight_shapes: count the parameters of transformers' Qwen3
    module itself (meta device, no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in ("Qwen3-8B", "Qwen3-4B"):
        cfg = transformers.Qwen3Config(**{k: v for k, v in QWEN3[name].items() if k != "architectures"})
        with torch.device("meta"):
            model = transformers.Qwen3ForCausalLM(cfg)
        a = analyze_program(qwen3_spec(name))
        d = a.dtype_bytes
        assert a.units[1].param_bytes == d * sum(p.numel() for p in model.model.layers[0].parameters())
        assert a.units[0].stored_bytes == d * model.model.embed_tokens.weight.numel()
        assert a.units[-1].param_bytes == d * (model.lm_head.weight.numel() + model.model.norm.weight.numel())
        n_params = sum(p.numel() for p in model.parameters())       # parameters() dedupes the tied matrix
        assert a.held_bytes(a.stage(0, a.num_units)) == d * n_params


def test_quantized_prefill_scratch_is_each_functions_largest_fp16_weight():
    """lower_quantized_gpu dequantizes a prefill function's weights one at a time into one reused buffer: the plan
    counts pre_attn's largest (q: 4096 x 4096) plus post_attn's largest (gate / up / down: 12288 x 4096) in fp16."""
    import dataclasses
    mix = ("q4_k",) * 2 + ("q6_k",) + ("q4_k",) * 3 + ("q6_k",)             # q, k, v, o, gate, up, down
    spec = dataclasses.replace(qwen3_spec("Qwen3-8B"), layer_types=(mix,) * 36, head_type="q6_k", embed_type="q4_k")
    a = analyze_program(spec)
    assert a.quantized_prefill_scratch_bytes == (4096 * 4096 + 12288 * 4096) * 2
    assert a.quantized_head_scratch_bytes == 151936 * 4096 * 2
    plain = analyze_program(qwen3_spec("Qwen3-8B"))
    assert plain.quantized_prefill_scratch_bytes == plain.quantized_head_scratch_bytes == 0
    # only v quantized: pre_attn's buffer is v's, post_attn has none
    only_v = ("",) * 2 + ("q8_0",) + ("",) * 4
    a_v = analyze_program(dataclasses.replace(qwen3_spec("Qwen3-8B"), layer_types=(only_v,) * 36))
    assert a_v.quantized_prefill_scratch_bytes == 4096 * 1024 * 2 and a_v.quantized_head_scratch_bytes == 0
