"""schedules/cpu/quant/dequantize.py (the quantized prefill path) against the gguf package's own NumPy
dequantizers: bit-exact in fp32 (the same formulas, one rounding each), fp16 output within fp16 rounding.
Weights come from helmc's quantizers (byte-identical to ggml's); nothing is stored."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tvm = pytest.importorskip("tvm")

from helmc.errors import HelmcError  # noqa: E402


def _run(qtype, n, k, out_dtype, raw):
    from helmc.schedules.cpu.quant.gemm import make_dequantize
    lib = tvm.compile(tvm.IRModule({"main": make_dequantize(qtype, n, k, out_dtype)}),
                      target=tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}))
    out = tvm.runtime.tensor(np.zeros((n, k), out_dtype))
    lib["main"](tvm.runtime.tensor(raw), out)
    return out.numpy()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q5_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16"])
def test_dequantize_matches_gguf(qtype, out_dtype):
    from helmc.model.quant_formats import quantize
    rng = np.random.default_rng(1)
    n, k = 7, 768
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3, (n, 1)).astype(np.float32)
    raw = quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype.upper()]).astype(np.float32)
    got = _run(qtype, n, k, out_dtype, raw).astype(np.float32)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"\n{qtype} -> {out_dtype}: max relative difference {err:.2e} vs gguf.quants.dequantize")
    assert err == 0.0 if out_dtype == "float32" else err < 2 ** -10


def test_mxfp4_every_scale_byte_and_nibble():
    """Every e8m0 byte (the subnormal scales of e = 0 and 1 and the overflow to inf of e >= 252 included) under every
    nibble: the fp32 dequantizer's bits are gguf's (ggml_e8m0_to_fp32_half times kvalues_mxfp4)."""
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = (np.arange(16) * 5 % 16) | (np.arange(16) << 4)     # weights 0-15 and 16-31: every value
    with np.errstate(over="ignore"):
        ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    got = _run("mxfp4", 256, 32, "float32", blocks)
    assert np.isinf(ref).any() and (ref[:2] != 0).any()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_bad_shapes_are_refused():
    from helmc.schedules.cpu.quant.gemm import make_dequantize
    with pytest.raises(HelmcError, match="multiple of its 256-weight block, found k=300"):
        make_dequantize("q4_k", 4, 300)
    with pytest.raises(HelmcError, match="out dtype expected one of"):
        make_dequantize("q8_0", 4, 64, "bfloat16")
