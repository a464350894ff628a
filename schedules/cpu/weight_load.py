"""Reading one weight element as fp32 inside a TIR kernel, whatever dtype the checkpoint stored.

The weight is never copied to fp32 in memory: each element is widened in a register right after its load,
so a linear layer streams 2 bytes per fp16/bf16 parameter from DRAM (thesis 4.1.5).
"""
from __future__ import annotations

from tvm import tirx

WEIGHT_DTYPES = ("float16", "bfloat16", "float32")

# Annotation for the kernels' small per-thread buffers (accumulators, widened weights): keep them as stack
# allocas, which LLVM promotes to registers. TVM otherwise turns every "local" allocation, and every one of
# 1 KiB or more, into a TVMBackendAllocWorkspace call, and the accumulators then went through memory on
# every FMA (seen in the generated assembly; GEMM ran at 20 GFLOPS instead of 60+ on 2 cores).
STACK = {"disable_lower_builtin": True}


def check_weight_dtype(dtype: str) -> None:
    if dtype not in WEIGHT_DTYPES:
        from helmc.errors import HelmcError
        raise HelmcError(f"CPU linear kernel: weight dtype expected one of {WEIGHT_DTYPES}, found {dtype!r}")


def load_dtype(stored_dtype: str) -> str:
    """dtype to declare the weight's load view with: bf16 weights are read as their raw uint16 bits (see
    `widen`); the kernel declares `T.decl_buffer(w.shape, load_dtype(..), data=w.data)` over the parameter."""
    return "uint16" if stored_dtype == "bfloat16" else stored_dtype


def widen(loaded: tirx.PrimExpr, stored_dtype: str, hardware_f16: bool = True) -> tirx.PrimExpr:
    """fp32 value of an element loaded through the `load_dtype` view of the weight.

    bf16 is the top half of an fp32, so widening is `bits << 16` reinterpreted: exact, and it vectorises
    to vpmovzxwd + vpslld on every x86 tier (no reliance on a bf16 type in the code generator).
    fp16 uses the hardware convert (vcvtph2ps) where F16C exists; without it LLVM emits one call to the
    runtime library's __extendhfsf2 per element (a symbol the loading process must provide, and a loop that
    cannot vectorise), so the portable tier decodes the fp16 bits with vectorisable integer arithmetic
    instead (measured on the 2-core EPYC: 0.86 GB/s against 0.39 GB/s with the library call).
    """
    if stored_dtype == "float32":
        return loaded
    if stored_dtype == "float16":
        if hardware_f16:
            return tirx.Cast("float32", loaded)
        return _f16_bits_to_f32(tirx.reinterpret("uint16", loaded))
    assert stored_dtype == "bfloat16", stored_dtype
    wide = tirx.Cast("uint32", loaded)
    return tirx.reinterpret("float32", tirx.shift_left(wide, tirx.const(16, "uint32")))


def _f16_bits_to_f32(bits: tirx.PrimExpr) -> tirx.PrimExpr:
    """IEEE half -> float from the raw bits, exact for normals, subnormals, inf and NaN; select-only, so
    it vectorises."""
    u32 = lambda v: tirx.const(v, "uint32")
    h = tirx.Cast("uint32", bits)
    sign = tirx.shift_left(tirx.bitwise_and(h, u32(0x8000)), u32(16))
    magnitude = tirx.shift_left(tirx.bitwise_and(h, u32(0x7FFF)), u32(13))
    exponent = tirx.bitwise_and(h, u32(0x7C00))
    # Rebias the exponent 15 -> 127 (add 112 << 23); inf/NaN (all-ones exponent) needs another 112 << 23.
    normal = tirx.bitwise_or(sign, magnitude + u32(0x38000000))
    special = tirx.bitwise_or(sign, magnitude + u32(0x70000000))
    as_float = tirx.reinterpret("float32", tirx.Select(exponent == u32(0x7C00), special, normal))
    # Subnormal halves: mantissa * 2^-24, signed.
    mantissa = tirx.Cast("float32", tirx.bitwise_and(h, u32(0x3FF)))
    subnormal_abs = mantissa * tirx.const(2.0 ** -24, "float32")
    subnormal = tirx.Select(sign != u32(0), -subnormal_abs, subnormal_abs)
    return tirx.Select(exponent == u32(0), subnormal, as_float)
