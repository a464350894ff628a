"""dispatch_prefill_gemm: prefill linears (symbolic token count, fp16 x and w) become calls of the runtime's cuBLAS
GEMM (helmc.gemm_nt_f16, registered by runtime/cuda_runtime.py); decode functions and other matmuls stay TVM's.
The numbers are checked on the GPU: tests/runtime/test_gpu_stage_prebuilt.py runs every prefill function of a tiny
Qwen3 stage against torch in fp32 (and times the GEMM probe against cuBLAS)."""
import pytest

tvm = pytest.importorskip("tvm")

from tvm import relax, tirx  # noqa: E402

from helmc.compiler.passes.compile_gpu_stage import rewrite_matmuls_fp32_accumulate  # noqa: E402
from helmc.compiler.passes.dispatch_prefill_gemm import GEMM_FUNC, dispatch_prefill_gemm  # noqa: E402
from helmc.runtime.cuda_runtime import PREFILL_GEMM_FUNC  # noqa: E402


def _linear(name: str, seq, w_dtype: str = "float16"):
    x = relax.Var("x", relax.TensorType([seq, 64], "float16"))
    w = relax.Var("w", relax.TensorType([96, 64], w_dtype))
    bb = relax.BlockBuilder()
    with bb.function(name, [x, w]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(relax.op.astype(w, "float16"), [1, 0]))  # [96, 64] -> [64, 96]
            y = bb.emit_output(relax.op.matmul(x, wt))
        bb.emit_func_output(y)
    return bb.get()[name]


def test_prefill_linears_call_the_runtime_gemm_and_decode_keeps_its_kernels():
    assert GEMM_FUNC == PREFILL_GEMM_FUNC
    seq = tirx.Var("seq", "int64")
    mod = tvm.IRModule({"lin_prefill": _linear("lin_prefill", seq), "lin_decode": _linear("lin_decode", 1),
                        "bf16_prefill": _linear("bf16_prefill", seq, "bfloat16")})
    out = dispatch_prefill_gemm(rewrite_matmuls_fp32_accumulate(mod))
    prefill = out["lin_prefill"].script()
    assert f'R.call_dps_packed("{GEMM_FUNC}"' in prefill and "R.matmul" not in prefill
    assert "R.Tensor((seq, 96), dtype=\"float16\")" in prefill
    for name in ("lin_decode", "bf16_prefill"):          # a GEMV, and a weight cuBLAS would need converted
        text = out[name].script()
        assert "call_dps_packed" not in text and "R.matmul" in text, name
