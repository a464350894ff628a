"""Cache blocking of the AMX prefill GEMM (gemm_amx.py): the knobs, the variants a benchmark compares, and the
per-shape choice measured on the GPU machine's Xeon.

Split out of gemm_amx.py so the kernel file holds the loops only; gemm_amx re-exports every name here.
"""
from __future__ import annotations

from dataclasses import dataclass

TILE_K = 32             # bf16 elements per A row (64 bytes)
TOKEN_BLOCK = 32        # tokens per C column pair: two B tiles


@dataclass(frozen=True)
class AmxBlocking:
    """Cache blocking of the AMX GEMM (see the module docstring)."""
    name: str = ""              # suffix of the kernel symbol ("" for the default blocking)
    k_block: int = 256          # K per block: rounded down to a multiple of 32 that divides K
    tasks: int = 16             # parallel tasks = the target's cores; each takes a contiguous group of panels
    token_chunk: int = 128      # tokens per pass over the weights (multiple of 32)
    prefetch: bool = True       # prefetch the next panel's weight rows into L2 while computing this one
    pack_bf16: bool = True      # bf16: copy each panel block into contiguous tiles (fp16 always packs)

    def __post_init__(self):
        assert self.k_block >= TILE_K and self.tasks >= 1, self
        assert self.token_chunk >= TOKEN_BLOCK and self.token_chunk % TOKEN_BLOCK == 0, self
        assert self.name == "" or self.name.isidentifier(), self


DEFAULT_BLOCKING = AmxBlocking()
# Alternatives a benchmark on the target can compare against the default (benchmarks/bench_cpu_gemv.py builds all).
BLOCKING_VARIANTS = (
    DEFAULT_BLOCKING,
    AmxBlocking(name="kc512", k_block=512),
    AmxBlocking(name="nopf", prefetch=False),
    AmxBlocking(name="direct", pack_bf16=False),
)


def blocking_named(name: str) -> AmxBlocking:
    """The variant of BLOCKING_VARIANTS called `name` ("default": DEFAULT_BLOCKING)."""
    for blocking in BLOCKING_VARIANTS:
        if (blocking.name or "default") == name:
            return blocking
    from helmc.errors import HelmcError
    raise HelmcError(f"AMX GEMM blocking: expected one of {[b.name or 'default' for b in BLOCKING_VARIANTS]}, "
                     f"found {name!r}")


# Best blocking per (N, K, weight dtype) for a 128-token prompt on the GPU machine's 16-core Xeon (AMX),
# measured there (benchmarks/bench_cpu_gemv.py --run-only, "amx_gemm": best of 5 interleaved
# rounds, weights cycled from DRAM; torch bf16 alongside). ms per variant default / kc512 / direct:
#   bf16 1024 x 4096   0.38 / 0.41 / 0.42    bf16 4096 x 4096   1.17 / 0.88 / 0.83
#   bf16 12288 x 4096  2.01 / 1.86 / 2.30    bf16 4096 x 12288  2.79 / 2.50 / 2.30
#   fp16 1024 x 4096   0.59 / 0.58 / 0.69    fp16 4096 x 4096   1.18 / 1.12 / 1.01
#   fp16 12288 x 4096  2.82 / 2.48 / 2.66    fp16 4096 x 12288  3.08 / 2.70 / 2.77
# fp16 always packs its panels (hi/lo split), so its "direct" is the default kernel: the spread between the
# two (1.18 vs 1.01 ms) is the run's noise, and kc512 is the fp16 choice everywhere.
# These were measured on the split (hi + lo) bf16 kernel. With bf16 activations (the default)
# the whole 8B block's 128-token prefill, 20 rounds each in one run: per-shape choice (this table)
# 6.0 ms, kc512 everywhere 6.0, direct everywhere 6.4, default everywhere 9.4 (that run's DRAM read was
# 154 GB/s against 187-189 for the others); torch bf16 6.7-7.2 ms. The table stays.
MEASURED_BLOCKING = {
    (1024, 4096, "bfloat16"): "default",
    (4096, 4096, "bfloat16"): "direct",
    (12288, 4096, "bfloat16"): "kc512",
    (4096, 12288, "bfloat16"): "direct",
}


def blocking_for(n: int, k: int, weight_dtype: str) -> AmxBlocking:
    """The blocking to build an AMX GEMM of N x K (summed N of a fused launch) with: the measured winner
    for the shapes of MEASURED_BLOCKING, else the rule they suggest -- fp16: kc512; bf16: default for
    small N (<= 2048, little work per core, so the larger K block does not pay), direct (A tiles read
    from W as stored) up to N = 8192 and for K > 4096, kc512 for larger N."""
    measured = MEASURED_BLOCKING.get((n, k, weight_dtype))
    if measured is not None:
        return blocking_named(measured)
    if weight_dtype == "float16":
        return blocking_named("kc512")
    if n <= 2048:
        return DEFAULT_BLOCKING
    if n <= 8192 or k > 4096:
        return blocking_named("direct")
    return blocking_named("kc512")
