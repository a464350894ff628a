"""compile_gpu_stage: Relax -> host library + prebuilt cubin; runtime/cuda_runtime's cubin callback.

The CPU-machine tests need nvcc (skipped without it) and check what can be checked without a GPU:
the cubin is an ELF for the asked arch, the index names the sha256 of exactly the CUDA source that
the host library embeds (what TVM hands the callback at load time), the upcast weights are read in
their stored dtype, and the runtime callback answers with that cubin and refuses other sources.
The gpu-marked test runs the stage on the GPU against numpy (float64 reference); no stored
references, nothing to regenerate.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct

import numpy as np
import pytest

from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage, find_nvcc, rewrite_matmuls_fp32_accumulate
from helmc.errors import HelmcError

try:  # the TVM compiler; absent where only the runtime-only TVM is (the GPU machine)
    import tvm
    from tvm import relax, tirx
    HAVE_COMPILER = True
except Exception:
    HAVE_COMPILER = False

H, N, EPS = 128, 256, 1e-6
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="needs the TVM compiler (helmc[compile])")
needs_nvcc = pytest.mark.skipif(not HAVE_COMPILER or find_nvcc() is None, reason="needs the TVM compiler and nvcc")


def _norm_linear(bb: relax.BlockBuilder, name: str, seq) -> None:
    """y = linear(rmsnorm(x) * g, w.float()) the way the ONNX import spells it (x*x, mean, sqrt, divide;
    astype + permute_dims + matmul), x fp32 [seq, H], g and w fp16."""
    x = relax.Var("x", relax.TensorType((seq, H), "float32"))
    g = relax.Var("g", relax.TensorType((H,), "float16"))
    w = relax.Var("w", relax.TensorType((N, H), "float16"))
    with bb.function(name, [x, g, w]):
        with bb.dataflow():
            ms = bb.emit(relax.op.mean(relax.op.multiply(x, x), axis=[-1], keepdims=True))
            inv = bb.emit(relax.op.divide(relax.const(1.0, "float32"),
                                          relax.op.sqrt(relax.op.add(ms, relax.const(EPS, "float32")))))
            h = bb.emit(relax.op.multiply(relax.op.astype(g, "float32"), relax.op.multiply(x, inv)))
            wt = bb.emit(relax.op.permute_dims(relax.op.astype(w, "float32"), [1, 0]))   # [N, H] -> [H, N]
            y = bb.emit_output(relax.op.matmul(h, wt))
        bb.emit_func_output(y)


def small_stage():
    bb = relax.BlockBuilder()
    _norm_linear(bb, "decode", 1)
    _norm_linear(bb, "prefill", tirx.Var("seq", "int64"))
    return bb.get()


def reference(x, g, w):
    x, g, w = (a.astype(np.float64) for a in (x, g, w))
    h = g * x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)
    return h @ w.T


@needs_compiler
def test_rewrite_reads_weights_in_stored_dtype():
    mod = rewrite_matmuls_fp32_accumulate(small_stage())
    for name in ("decode", "prefill"):
        text = mod[name].script()
        assert 'R.astype(w, dtype="float32")' not in text, text
        assert 'out_dtype="float32"' in text, text
    # The norm weight's upcast is not a matmul operand and must stay.
    assert 'R.astype(g, dtype="float32")' in mod["decode"].script()


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_nvcc_failure_is_a_clear_error(tmp_path):
    from helmc.compiler.passes.compile_gpu_stage import compile_cuda_source

    with pytest.raises(HelmcError, match="nvcc failed for sm_90"):
        compile_cuda_source('extern "C" __global__ void k() { undeclared_name = 1; }', "sm_90", str(tmp_path / "k.cubin"))
    assert not (tmp_path / "k.cubin").exists()


@needs_compiler
def test_bad_arch_is_refused(tmp_path):
    with pytest.raises(HelmcError, match="expected a CUDA arch"):
        compile_gpu_stage(small_stage(), "sm_91", str(tmp_path))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not HAVE_COMPILER or find_nvcc() is None:
        pytest.skip("needs the TVM compiler and nvcc")
    out = tmp_path_factory.mktemp("gpu_stage")
    files = compile_gpu_stage(small_stage(), "sm_90", str(out), name="stage")
    return out, files


@needs_nvcc
def test_builds_cubin_for_sm90(built):
    out, files = built
    assert files == ("stage.so", "stage.sm_90.cubin", "stage.cubins.json", "stage.cu")
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-")]
    cubin = (out / "stage.sm_90.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"
    flags = struct.unpack_from("<I", cubin, 48)[0]          # ELF64 e_flags: the SM number
    assert 90 in ((flags >> 8) & 0xFF, flags & 0xFF), hex(flags)
    index = json.loads((out / "stage.cubins.json").read_text())
    source = (out / "stage.cu").read_text()
    assert index["arch"] == "sm_90"
    assert index["cubins"] == {hashlib.sha256(source.encode()).hexdigest(): "stage.sm_90.cubin"}
    assert "--use_fast_math" not in index["nvcc_flags"]
    # The host library embeds exactly this source: it is what TVM hashes-to-cubin at load time.
    assert source.encode() in (out / "stage.so").read_bytes()
    # No kernel writes an upcast or transposed copy of the weight: fp16 is read in the matmul.
    assert "T_transpose" not in source
    kernels_reading_w = [k for k in re.findall(r"__global__ void[^;{]*\{", source) if "w_ptr" in k]
    assert len(kernels_reading_w) == 2 and all("half* __restrict__ w_ptr" in k for k in kernels_reading_w)


@needs_nvcc
def test_runtime_callback_answers_with_prebuilt_cubin(built):
    import tvm_ffi

    from helmc.runtime import cuda_runtime

    out, _ = built
    saved = tvm_ffi.get_global_func(cuda_runtime.CUDA_COMPILE_CALLBACK, allow_missing=True)
    try:
        cuda_runtime.register_cubin_index(str(out / "stage.cubins.json"))
        callback = tvm_ffi.get_global_func(cuda_runtime.CUDA_COMPILE_CALLBACK)
        source = (out / "stage.cu").read_text()
        assert bytes(callback(source)) == (out / "stage.sm_90.cubin").read_bytes()
        with pytest.raises(Exception, match="no prebuilt cubin"):
            callback(source + "// edited\n")
    finally:
        if saved is not None:
            tvm_ffi.register_global_func(cuda_runtime.CUDA_COMPILE_CALLBACK, saved, override=True)
        cuda_runtime._callback_registered = False


def test_cubin_index_errors_name_the_file(tmp_path):
    from helmc.runtime import cuda_runtime

    with pytest.raises(cuda_runtime.CudaRuntimeError, match="found no such file"):
        cuda_runtime.register_cubin_index(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"format_version": 99, "arch": "sm_90", "cubins": {}}))
    with pytest.raises(cuda_runtime.CudaRuntimeError, match="format_version expected 1, found 99"):
        cuda_runtime.register_cubin_index(str(tmp_path / "bad.json"))


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs cupy and an NVIDIA GPU")
def test_runs_on_gpu_against_numpy(tmp_path):
    """With the compiler: build for this GPU and compare to numpy. With the runtime-only TVM (the GPU machine) the
    prebuilt stage is tests/runtime/test_gpu_stage_prebuilt.py's."""
    import cupy as cp

    from helmc.runtime.cuda_runtime import cupy_to_tvm, load_gpu_vm, tvm_to_cupy

    if not HAVE_COMPILER:
        pytest.skip("runtime-only TVM: tests/runtime/test_gpu_stage_prebuilt.py runs a stage prebuilt by "
                    "`python -m tests.device.build_gpu_stage`")
    cc = cp.cuda.Device(0).compute_capability       # e.g. "90"
    compile_gpu_stage(small_stage(), f"sm_{cc}", str(tmp_path), name="stage")
    vm = load_gpu_vm(str(tmp_path / "stage.so"), str(tmp_path / "stage.cubins.json"))
    rng = np.random.default_rng(0)
    g = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    w = (0.05 * rng.standard_normal((N, H))).astype(np.float16)
    for name, seq in (("decode", 1), ("prefill", 37)):
        x = rng.standard_normal((seq, H)).astype(np.float32)
        got = cp.asnumpy(tvm_to_cupy(vm[name](*(cupy_to_tvm(cp.asarray(a)) for a in (x, g, w)))))
        ref = reference(x, g, w)
        diff = float(np.max(np.abs(got - ref)))
        print(f"{name}: max |helmc - numpy float64| = {diff:.2e}")
        assert np.isfinite(got).all() and diff < 1e-3 * max(1.0, float(np.max(np.abs(ref))))


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_paged_attention_is_built_ahead_of_time(tmp_path):
    """The KV cache's decode kernels are a cubin of the bundle, specialised for the model's head_dim and group;
    a shape the kernel does not support is refused before nvcc runs."""
    from helmc.compiler.passes.compile_gpu_stage import compile_paged_attention
    from helmc.runtime.kv.cuda_ops import PAGED_ATTENTION_CUBIN

    name = compile_paged_attention(128, 4, "sm_90", str(tmp_path))
    assert name == PAGED_ATTENTION_CUBIN and sorted(os.listdir(tmp_path)) == [PAGED_ATTENTION_CUBIN]
    cubin = (tmp_path / name).read_bytes()
    assert cubin[:4] == b"\x7fELF"
    assert b"paged_decode_partial" in cubin and b"paged_decode_merge" in cubin and b"paged_append_decode" in cubin
    # Gemma 3's head_dim 256: flash_prefill's 66 KB of tiles are dynamic shared memory (static past 48 KB is a
    # ptxas error), so the cubin builds with every kernel in it
    big = tmp_path / "d256"
    big.mkdir()
    cubin = (big / compile_paged_attention(256, 2, "sm_90", str(big))).read_bytes()
    assert b"flash_prefill_v3" in cubin and b"paged_decode_fused_append" in cubin
    with pytest.raises(HelmcError, match="head_dim expected a multiple of 32 in 32..256, found 80"):
        compile_paged_attention(80, 4, "sm_90", str(tmp_path / "bad"))
    with pytest.raises(HelmcError, match="expected a CUDA arch"):
        compile_paged_attention(128, 4, "sm_91", str(tmp_path / "bad"))


@needs_nvcc
def test_quantized_gpu_stage_builds_with_its_kernels(quantized_gpu_stage_files):
    """A Q4_K_M-like spec (a second block signature with down_proj in q6_k; lm_head q6_k): every decode linear
    is a fused dequantize-GEMV on the raw blocks, every prefill weight one dequantize, in one cubin. The stage (with
    batched decode variants) is the one test_lower_decode_gemv.py checks, compiled once for both."""
    from gpu_stage_specs import quantized_lowered

    lowered, _ = quantized_lowered("float16")
    down = [p for p in lowered["post_attn_decode_t1"].params if str(p.name) == "w4"][0]
    assert str(down.ty.dtype) == "uint8" and [int(d) for d in down.ty.shape.values] == [256, 420]   # 2 q6_k blocks
    decode = lowered["post_attn_decode_t1"].script()
    # down_proj + the residual add, gate and up + SwiGLU: one launch each (the int8 GEMV's epilogues)
    assert "helmc_gpu_gemv8_res_q6_k_n256_k512_r2w8u2" in decode and "R.matmul" not in decode
    assert "helmc_gpu_gemv8_swiglu_q4_k_n512_k256_r1w8u2" in decode and "R.sigmoid" not in decode
    assert "helmc_gpu_dequantize_q6_k_n256_k512" in lowered["post_attn_prefill_t1"].script()
    out, files = quantized_gpu_stage_files
    source = (out / "gpu_stage.cu").read_text()
    for kernel in ("gemv8_q4_k_n128_k256_r2w8u2", "gemv8_res_q6_k_n256_k512_r2w8u2", "gemv8_q6_k_n512_k256_r2w8u2",
                   "gemv8_swiglu_q4_k_n512_k256_r1w8u2",
                   "dequantize_q4_k_n512_k256"):
        assert f"helmc_gpu_{kernel}" in source, kernel
    assert (out / files[1]).read_bytes()[:4] == b"\x7fELF"


def test_quantized_prefill_dequantizes_each_weight_just_before_its_matmul():
    """The prefill functions dequantize one weight at a time, inside the dataflow block, right before the matmul
    that reads it: each fp16 copy is dead after its matmul, so the VM's memory planning reuses one buffer (what the
    plan counts, analyze_program.quantized_prefill_scratch_bytes) instead of holding every weight's copy."""
    import re
    from gpu_stage_specs import quantized_lowered

    lowered, _ = quantized_lowered("float16")      # the shared Q4_K_M-like stage: signature 0's linears all q4_k
    for name, weights in (("pre_attn_prefill", 3), ("post_attn_prefill", 4)):
        script = lowered[name].script()
        body = script[script.index("R.dataflow()"):]
        events = [m.group(0) for m in re.finditer(r"helmc_gpu_dequantize_q4_k_\w+|R\.matmul", body)]
        assert events.count("R.matmul") == weights and len(events) == 2 * weights, (name, events)
        # dequantize, its matmul, dequantize, its matmul, ...: never two copies alive at once
        assert all(e.startswith("helmc_gpu_dequantize") for e in events[0::2]), (name, events)
        assert all(e == "R.matmul" for e in events[1::2]), (name, events)
        assert "helmc_gpu_dequantize" not in script[:script.index("R.dataflow()")], name


K_QUANT_ROW_BYTES = {"q5_k": 176, "q3_k": 110, "q5_0": 8 * 22, "iq4_xs": 136, "mxfp4": 8 * 17}   # per row of k = 256
DP4A_K_QUANTS = ("q5_k", "q3_k")        # decoded by the int8-activation GEMV (quant_gemv_int8.py)


@needs_nvcc
def test_k_quant_gpu_stage_builds_with_its_kernels(tmp_path):
    """Block i's linears in the i-th of Q5_K / Q3_K / Q5_0 / IQ4_XS / MXFP4 (one block signature each, so one stage
    and one nvcc run cover them all; the lm_head in q6_k): each type's decode linears are its fused dequantize-GEMV on the
    raw blocks (Q5_K / Q3_K: the int8-activation GEMV, q/k/v in one launch, gate/up with the SwiGLU, down with the
    residual add, as Q4_K's), its prefill weights one dequantize each, in one cubin."""
    from helmc.compiler.passes.export_block import export_functions
    from helmc.compiler.passes.import_relax import import_functions
    from helmc.compiler.passes.lower_quantized_gpu import lower_quantized_gpu
    from helmc.compiler.passes.quantize_functions import quantize_functions
    from helmc.model.spec import LINEAR_NAMES, ModelSpec, with_weight_types
    from helmc.testing import tiny_config
    from helmc.runtime.stage import block_function_name

    qtypes = tuple(K_QUANT_ROW_BYTES)
    cfg = tiny_config("qwen3", num_layers=len(qtypes), head_dim=64, dtype="float16", tie=False, hidden_size=256,
                      intermediate_size=512).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    types = {f"model.layers.{i}.{n}": qtype for i, qtype in enumerate(qtypes) for n in LINEAR_NAMES}
    types["lm_head.weight"] = "q6_k"
    spec = with_weight_types(ModelSpec.from_hf_config(cfg), types)
    assert len(spec.block_signatures()) == len(qtypes)
    mod, weight_types = quantize_functions(import_functions(export_functions(spec, act_dtype="float16")), spec)
    lowered = lower_quantized_gpu(mod, weight_types)
    files = compile_gpu_stage(mod, "sm_90", str(tmp_path), weight_types=weight_types)
    source = (tmp_path / "gpu_stage.cu").read_text()
    assert (tmp_path / files[1]).read_bytes()[:4] == b"\x7fELF"
    for j, qtype in enumerate(qtypes):
        decode_fn = lowered[block_function_name("post_attn", "decode", j)]
        gate = [p for p in decode_fn.params if str(p.name) == "w2"][0]
        assert str(gate.ty.dtype) == "uint8" and [int(d) for d in gate.ty.shape.values] == \
            [512, K_QUANT_ROW_BYTES[qtype]], qtype                                          # k = 256
        decode = decode_fn.script()
        assert "R.matmul" not in decode, qtype
        if qtype in DP4A_K_QUANTS:
            gemvs = (f"gemv8_swiglu_{qtype}_n512_k256_r1w8u2", f"gemv8_res_{qtype}_n256_k512_r2w8u2",
                     f"gemv8_{qtype}_n256_k256_r2w8u2")
            assert "R.sigmoid" not in decode and "helmc_gpu_gemv_" not in decode, qtype
            pre = lowered[block_function_name("pre_attn", "decode", j)].script()
            assert f"helmc_gpu_gemv8_{qtype}_n256_128_128_k256_r2w8u2" in pre, qtype     # q, k, v: one launch
            gemvs += (f"gemv8_{qtype}_n256_128_128_k256_r2w8u2",)
        else:
            gemvs = (f"gemv_{qtype}_n512_k256_r1w4u4", f"gemv_{qtype}_n256_k512_r1w4u4")
        for kernel in gemvs[:2]:
            assert f"helmc_gpu_{kernel}" in decode, kernel
        assert f"helmc_gpu_dequantize_{qtype}_n512_k256" in \
            lowered[block_function_name("post_attn", "prefill", j)].script(), qtype
        for kernel in gemvs + (f"dequantize_{qtype}_n512_k256", f"dequantize_{qtype}_n256_k512"):
            assert f"helmc_gpu_{kernel}" in source, kernel
