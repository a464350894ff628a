"""lower_decode_gemv / lower_quantized_gpu on a GPU stage with batched decode variants: every linear of
every decode function (decode, decode_b2, decode_b4; each weight signature; the head) becomes helmc's m-row GEMV
for its row count -- fp16 / bf16 weights schedules/gpu/gemv.py, quantized ones quant_gemv.py -- and prefill keeps
its matmuls; the stage builds to one sm_90 cubin holding those kernels (nvcc, no GPU).
Fused launches: q, k, v are one launch, gate / up / SwiGLU one, down_proj / residual add one (and fuse_gpu_norms' q and
k norm + RoPE one), and the decode RMSNorms go into the GEMVs that read them (fuse_norm_gemv); the built stage's
decode functions launch 8 kernels fewer per block than before."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("tvm.relax")

from helmc.compiler.passes.compile_gpu_stage import build_gpu_executable, kernel_launches  # noqa: E402
from helmc.compiler.passes.dispatch_prefill_gemm import GEMM_FUNC  # noqa: E402
from helmc.compiler.passes.lower_decode_gemv import lower_decode_gemv  # noqa: E402

from gpu_stage_specs import (BATCHES, imported_gpu_stage as _imported, quantized_lowered,  # noqa: E402
                             tiny_gpu_spec as _spec)


def _rows_of(kernel: str) -> int:
    """The row count m in a GEMV's symbol (gemv.gemv_symbol: _m{m}_n..; quant_gemv.gemv_symbol: .._k{k}_m{m}, none
    for m = 1)."""
    found = re.search(r"_m(\d+)_n", kernel) or re.search(r"_k\d+_m(\d+)", kernel)
    return int(found.group(1)) if found else 1


def _lowered(dtype: str, quantized: bool):
    mod, weight_types = quantized_lowered(dtype) if quantized else _imported(dtype, quantized)
    return lower_decode_gemv(mod), weight_types


@pytest.mark.parametrize("dtype,quantized", [("float16", False), ("bfloat16", False), ("float16", True)])
def test_every_decode_linear_is_an_m_row_gemv(dtype, quantized):
    spec = _spec(dtype, quantized)
    mod, _ = _lowered(dtype, quantized)
    names = {g.name_hint for g in mod.get_global_vars()}
    decode = sorted(n for n in names if re.search(r"_decode(_b\d+)?(_t\d+)?$", n))
    assert len(decode) == (3 * len(spec.block_signatures()) - (len(spec.block_signatures()) - 1)) * (1 + len(BATCHES))
    for name in decode:
        m = int(re.search(r"_decode(?:_b(\d+))?", name).group(1) or 1)
        script = mod[name].script()
        assert "R.matmul" not in script, name
        kernels = set(re.findall(r"helmc_gpu_gemv8?_\w+", script))
        assert kernels and all(_rows_of(k) == m for k in kernels), (name, kernels)
        short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        assert quantized or all(re.match(rf"helmc_gpu_gemv_(res_|swiglu_)?{short}_", k) for k in kernels), (name, kernels)
    assert "R.matmul" in mod["post_attn_prefill"].script() or quantized


@pytest.mark.slow
def test_batched_stage_builds_to_one_cubin(quantized_gpu_stage_files):
    out, files = quantized_gpu_stage_files
    source = (out / "gpu_stage.cu").read_text()
    for kernel in ("gemv8_q4_k_n128_k256_r2w8u2", "gemv8_q4_k_n128_k256_m4_r2w8u2", "gemv8_q6_k_n256_k512_m2_r2w8u2",
                   "gemv8_q6_k_n512_k256_m4_r2w8u2"):
        assert f"helmc_gpu_{kernel}_kernel" in source, kernel
    assert (out / files[1]).read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_launch_per_shared_x_and_epilogues(dtype):
    mod, _ = _lowered(dtype, False)
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for m in (1, *BATCHES):
        tail = "" if m == 1 else f"_b{m}"
        pre, post = mod[f"pre_attn_decode{tail}"].script(), mod[f"post_attn_decode{tail}"].script()
        # q [256, 256], k and v [128, 256]: one launch, each output its own tuple field
        assert re.findall(r"helmc_gpu_gemv\w+", pre) == [f"helmc_gpu_gemv_{short}_m{m}_n256_128_128_k256"], pre
        assert re.findall(r"helmc_gpu_gemv\w+", post) == [
            f"helmc_gpu_gemv_{short}_m{m}_n256_k256", f"helmc_gpu_gemv_swiglu_{short}_m{m}_n512_k256",
            f"helmc_gpu_gemv_res_{short}_m{m}_n256_k512"], post
        assert "R.sigmoid" not in post and re.search(r"\bgv = R.call_tir\(helmc_gpu_gemv_res_", post), post
    # o_proj's residual add feeds the next RMSNorm: left for fuse_gpu_norms' add + RMSNorm
    assert "R.add(x, lv" in mod["post_attn_decode"].script()
    unfused, _ = _imported(dtype, False)
    assert "n256_128_128" not in lower_decode_gemv(unfused, fuse=False)["pre_attn_decode"].script()


@pytest.mark.slow
def test_decode_launches_per_block_fall_from_13_to_5():
    """The built stage's decode functions: per block 6 + 7 launches one per linear (rms_norm, q, k, v, 2 norm_rope;
    o_proj, add_rms_norm, gate, up, SwiGLU, down, add), 2 + 3 merged (qkv with the RMSNorm prologue, q/k norm_rope;
    o_proj + residual, gate/up/SwiGLU with the RMSNorm prologue, down + add: fuse_norm_gemv); the head's norm goes
    into its GEMV; prefill unchanged."""
    mod, _ = _imported("float16", False)
    before = kernel_launches(build_gpu_executable(mod, "sm_90", merge_launches=False))
    after = kernel_launches(build_gpu_executable(mod, "sm_90"))
    for tail in ("", *(f"_b{b}" for b in BATCHES)):
        assert (len(before[f"pre_attn_decode{tail}"]), len(before[f"post_attn_decode{tail}"])) == (6, 7), before
        assert (len(after[f"pre_attn_decode{tail}"]), len(after[f"post_attn_decode{tail}"])) == (2, 3), after
        pre, post = after[f"pre_attn_decode{tail}"], after[f"post_attn_decode{tail}"]
        assert pre[0].startswith("helmc_gpu_gemv_norm") and pre[1].startswith("helmc_gpu_rms_norm_rope_qk_"), after
        assert [k.split("_f16")[0] for k in post] == ["helmc_gpu_gemv_res", "helmc_gpu_gemv_norm358637bd_swiglu",
                                                      "helmc_gpu_gemv_res"], post
        assert len(after[f"head_decode{tail}"]) == len(before[f"head_decode{tail}"]) - 1
    for func, gemms in (("pre_attn_prefill", 3), ("post_attn_prefill", 4)):  # TVM numbers its kernels per build
        assert len(after[func]) == len(before[func]) and after[func].count(GEMM_FUNC) == gemms, (before, after)
