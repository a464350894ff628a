"""BuildOptions: what a build is asked for beyond the model and the machine, with the defaults defined once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from helmc.errors import HelmcError


@dataclass(frozen=True)
class BuildOptions:
    prompt_len: int = 128              # the workload the plan optimises for
    output_len: int = 128
    batch: int = 1                     # sequences decoded at once (`helmc serve --max-batch`)
    stream_prefill: bool = True        # the CPU blocks' prefill on the GPU, their weights streamed over PCIe
    hybrid: bool = True                # hybrid decode layouts allowed (pipeline.hybrid_allowed)
    prefill_activations: str = "model" # AMX prefill GEMM inputs: "model" (bf16) or "fp32" (hi + lo)
    quant: str = ""                    # "" (weights as stored) or a weight_types.QUANT_MIXES name
    copy_weights: bool = False         # the safetensors copied into the bundle
    use_cache: bool = True             # reuse the artifact cache's stages
    cache_dir: str | None = None       # the artifact cache (None: HELMC_CACHE_DIR or artifacts/cache)
    quiet: bool = False                # no progress lines

    @classmethod
    def from_keywords(cls, options: dict) -> "BuildOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise HelmcError(f"build options: expected keywords among {', '.join(sorted(names))}, found "
                             f"{', '.join(unknown)}")
        return cls(**options)


def build_options(options: BuildOptions | None, keywords: dict) -> BuildOptions:
    """`options`, or a BuildOptions of `keywords` (a build takes one or the other)."""
    if options is not None and keywords:
        raise HelmcError(f"build: expected a BuildOptions or its fields as keywords, found both ({', '.join(keywords)})")
    return options if options is not None else BuildOptions.from_keywords(keywords)
