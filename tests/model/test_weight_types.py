"""The weight-type registry: its table against gguf's, its mixes, its kernel references, the CLI's choices."""
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")

from helmc.errors import HelmcError  # noqa: E402
from helmc.model.weight_types import (BLOCK_TYPES, GPU_INT8_TYPES, QUANT_MIXES, WEIGHT_TYPES, block_type,  # noqa: E402
                                      quant_blocks, quant_mix, weight_type)

_FILE_TYPES = {"q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q3_k": "MOSTLY_Q3_K_S", "q3_k_m": "MOSTLY_Q3_K_M",
               "q4_k": "MOSTLY_Q4_K_S", "q4_k_m": "MOSTLY_Q4_K_M",
               "q5_k": "MOSTLY_Q5_K_S", "q5_k_m": "MOSTLY_Q5_K_M"}


def test_table_matches_ggufs_types_and_sizes():
    for name, t in WEIGHT_TYPES.items():
        g = gguf.GGMLQuantizationType[name.upper()]
        assert t.ggml_id == int(g), name
        assert gguf.GGML_QUANT_SIZES[g] == (t.block_weights, t.block_bytes), name
        assert t.is_block_quantized == (name in BLOCK_TYPES)
        assert bool(t.dtype) != t.is_block_quantized, name


def test_geometry_and_lookups():
    assert quant_blocks()["q6_k"] == (256, 210)
    assert weight_type("q4_0").row_bytes(64) == 36 and weight_type("f16").row_bytes(10) == 20
    assert weight_type("q8_0").tensor_bytes(4 * 64) == 4 * 2 * 34
    with pytest.raises(HelmcError, match="q4_0"):
        weight_type("q4_0").row_bytes(48)
    with pytest.raises(HelmcError, match="expected one of .*found 'q2_k'"):
        weight_type("q2_k")
    with pytest.raises(HelmcError, match="found 'f16'"):
        block_type("f16")


def test_mixes_name_their_gguf_file_type_and_types():
    assert set(QUANT_MIXES) == set(_FILE_TYPES)
    for name, m in QUANT_MIXES.items():
        assert gguf.LlamaFileType(m.file_type).name == _FILE_TYPES[name]
        assert m.linear_type in m.types and m.fallback in m.types
        for t in m.types:
            assert t in BLOCK_TYPES, (name, t)
    with pytest.raises(HelmcError, match="expected one of q8_0, q4_0.*found 'q2_k_m'"):
        quant_mix("q2_k_m")


@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m"])
def test_k_m_mixes_are_llama_cpps(mix):
    """llama_tensor_get_type for MOSTLY_Q4_K_M / Q5_K_M: Q6_K for the output and, in the blocks use_more_bits
    picks (the first and last eighth, every third between), for attn_v and ffn_down."""
    from helmc.compiler.quantize_checkpoint import mixed_type
    from helmc.model.weight_types import use_more_bits
    n, base = 16, mix[:4]
    more = [i for i in range(n) if use_more_bits(i, n)]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert mixed_type(mix, "lm_head.weight", n) == "q6_k"
    assert mixed_type(base, "lm_head.weight", n) == base
    for i in range(n):
        for local in ("self_attn.v_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight"):
            want = "q6_k" if i in more and not local.endswith("q_proj.weight") else base
            assert mixed_type(mix, f"model.layers.{i}.{local}", n) == want
            assert mixed_type("q8_0", f"model.layers.{i}.{local}", n) == "q8_0"


@pytest.mark.parametrize("n", [4, 16, 36])
def test_q3_k_m_is_llama_cpps(n):
    """llama_tensor_get_type for MOSTLY_Q3_K_M in a dense non-Falcon model: output Q6_K; attn_v Q5_K in blocks 0
    and 1, Q4_K after; ffn_down Q5_K in the first n/16 blocks, Q4_K after; attn_output Q4_K; the rest Q3_K."""
    from helmc.compiler.quantize_checkpoint import mixed_type
    assert mixed_type("q3_k_m", "lm_head.weight", n) == "q6_k"
    assert mixed_type("q3_k", "lm_head.weight", n) == "q3_k"
    down = {i: mixed_type("q3_k_m", f"model.layers.{i}.mlp.down_proj.weight", n) for i in range(n)}
    assert [i for i, t in down.items() if t == "q5_k"] == list(range(n // 16))
    assert all(t == "q4_k" for i, t in down.items() if i >= n // 16)
    v = [mixed_type("q3_k_m", f"model.layers.{i}.self_attn.v_proj.weight", n) for i in range(n)]
    assert v == ["q5_k", "q5_k"] + ["q4_k"] * (n - 2)
    for i in range(n):
        assert mixed_type("q3_k_m", f"model.layers.{i}.self_attn.o_proj.weight", n) == "q4_k"
        for local in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight",
                      "mlp.up_proj.weight"):
            assert mixed_type("q3_k_m", f"model.layers.{i}.{local}", n) == "q3_k"
        assert mixed_type("q3_k", f"model.layers.{i}.mlp.down_proj.weight", n) == "q3_k"


def test_block_quantizers_resolve_and_write_their_geometry():
    import numpy as np
    for name in BLOCK_TYPES:
        t = WEIGHT_TYPES[name]
        blocks = np.random.default_rng(0).standard_normal((3, t.block_weights)).astype(np.float32)
        assert t.maker("block_quantizer")(blocks).reshape(3, -1).shape == (3, t.block_bytes)
    with pytest.raises(HelmcError, match="no gpu_gemv_int8"):
        WEIGHT_TYPES["q8_0"].maker("gpu_gemv_int8")


def test_kernel_references_resolve_to_the_kernels_types():
    pytest.importorskip("tvm.tirx")
    from helmc.schedules.gpu.quant_gemv import FORMATS
    from helmc.schedules.gpu.quant_gemv_int8 import INT8_TYPES
    for name in BLOCK_TYPES:
        t = WEIGHT_TYPES[name]
        assert callable(t.maker("cpu_gemv")) and callable(t.maker("gpu_gemv")) and len(t.gpu_gemv_tuning) == 3
        assert name in FORMATS
    assert set(GPU_INT8_TYPES) == set(INT8_TYPES)


def test_the_table_imports_nothing_heavy():
    code = ("import sys, helmc.model.weight_types; "
            "heavy = [m for m in ('numpy', 'gguf', 'tvm', 'torch') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_quant_choices_are_the_registrys():
    from helmc.cli.main import main
    build = main.commands["build"]
    opt = next(p for p in build.params if p.name == "quant")
    assert tuple(opt.type.choices) == tuple(QUANT_MIXES)
