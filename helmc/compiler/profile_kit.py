"""Build the profile kit (helmc/hardware/kit.py): the kernels and synthetic stages `helmc profile` measures with,
compiled for one target as `helmc build` would compile for it.

    kit_dir = ensure_kit(KitTarget.of_profile(hw))      # cached: a second profile of this machine compiles nothing
    build_kit(out_dir, target)                            # a kit for another machine (e.g. the GPU test machine)

The target is what the code depends on, as for a bundle: the CPU features (ISA tier and LLVM target), the core
count (parallel split counts), the L3 (which sizes the reads) and the CUDA arch of the GPU stage.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from helmc.compiler.artifact_cache import ArtifactCache, cache_key
from helmc.compiler.frame_modules import frames_of_no_module_remembered
from helmc.errors import HelmcError
from helmc.hardware.kit import (FLOAT_TYPES, FUSED_LINEARS, GPU_FUSED_TYPES, GPU_GEMV_DIR, GPU_GEMV_NAME,
                                KERNELS_LIB, KIT_FORMAT_VERSION, QUANT_FUSED_ROLES, QUANT_ROLES, QUANT_TYPES,
                                QUICK_BLOCK, ROWS_MEASURED, BlockShape, KitKernel, ProfileKit)
from helmc.hardware.profile import PROFILE_FORMAT_VERSION, CpuProfile, GpuProfile, HardwareProfile, LinkProfile

SYNTHETIC_LAYERS = 8             # blocks per timed step of the synthetic stages (quick: 4)
READ_MIN_BYTES = 512 << 20       # the DRAM read covers at least this and 4 x L3
QUICK_READ_BYTES = 64 << 20


@dataclass(frozen=True)
class KitTarget:
    features: tuple[str, ...]
    l3_bytes: int
    cores: int
    gpu_arch: str = ""
    quick: bool = False

    @classmethod
    def of_profile(cls, hw: HardwareProfile, quick: bool = False, with_gpu: bool = True) -> "KitTarget":
        """The target a profile (measured here, or another machine's hardware.json) describes."""
        arch = hw.gpu.arch if (with_gpu and hw.gpu is not None) else ""
        return cls(tuple(hw.cpu.features), hw.cpu.l3_bytes, hw.cpu.cores, arch, quick)

    @property
    def block(self) -> BlockShape:
        return QUICK_BLOCK if self.quick else BlockShape()

    @property
    def layers(self) -> int:
        return 4 if self.quick else SYNTHETIC_LAYERS


def _kernels(target: KitTarget, isa) -> tuple[dict, list[KitKernel]]:
    """Every decode GEMV of one block per weight type, as lower_linear emits them for one token and for a batched
    step of each ROWS_MEASURED count of sequences."""
    from helmc.schedules.cpu.gemv import make_gemv
    from helmc.schedules.cpu.gemv_fused import make_gemv_multi, make_gemv_swiglu
    from helmc.schedules.cpu.quant.decode_gemv import make_gemv_quant
    from helmc.schedules.cpu.quant.gemv_int8_multi import make_gemv_quant_int8_multi, quant_gemvs_fuse
    b = target.block
    H, I, Q, KV = b.hidden, b.ffn, b.q_dim, b.kv_dim
    funcs, kernels = {}, []

    @functools.lru_cache(maxsize=None)
    def made(make, *args, **kw):
        """Roles of one shape share a kernel (k and v; q and o where the block is square), written once: TVMScript
        takes ~0.15 s a kernel, and a third of the calls below would repeat one."""
        return make(*args, **kw)

    def add(weight_type, role, m, f):
        name = str(f.attrs["global_symbol"])
        # k and v share a shape, so a kernel; one symbol never stands for two row counts
        assert all(k.rows == m for k in kernels if k.name == name), name
        funcs[name] = f
        kernels.append(KitKernel(weight_type, role, name, m))
    for m in ROWS_MEASURED:
        for t in FLOAT_TYPES:
            add(t, "qkv", m, made(make_gemv_multi, m, (Q, KV, KV), H, t, isa))
            add(t, "o", m, made(make_gemv, m, H, Q, t, isa))
            add(t, "swiglu", m, made(make_gemv_swiglu, m, I, H, t, isa))
            add(t, "down", m, made(make_gemv, m, H, I, t, isa))
        shapes = b.linear_shapes()
        for t in QUANT_TYPES:
            # the launches the stage would fuse (q/k/v, gate/up) read x of K = hidden
            for role in QUANT_FUSED_ROLES if quant_gemvs_fuse(t, isa, m, H) else QUANT_ROLES:
                linears = FUSED_LINEARS.get(role, (role,))
                n, k = shapes[linears[0]]
                add(t, role, m, made(make_gemv_quant_int8_multi, t, tuple(shapes[x][0] for x in linears), k, isa)
                    if len(linears) > 1 else made(make_gemv_quant, t, n, k, isa, m=m))
    return funcs, kernels


def build_gpu_gemv_kernels(out_dir: str, block: BlockShape, arch: str) -> tuple[KitKernel, ...]:
    """gpu_gemv_funcs compiled for `arch` into out_dir/GPU_GEMV_DIR (compile_gpu_stage's files, the source left
    out)."""
    import tvm
    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage
    funcs, kernels = gpu_gemv_funcs(block)
    d = os.path.join(out_dir, GPU_GEMV_DIR)
    os.makedirs(d, exist_ok=True)
    files = compile_gpu_stage(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}), arch, d,
                              name=GPU_GEMV_NAME)
    for f in files:
        if f.endswith(".cu"):
            os.remove(os.path.join(d, f))           # the source, for reading only
    return kernels


def gpu_gemv_funcs(block: BlockShape) -> tuple[dict, tuple[KitKernel, ...]]:
    """({symbol: PrimFunc}, KitKernels): helmc's GPU decode GEMVs of one block per weight type, at the GPU stage's
    tunings and launch forms (lower_quantized_gpu, lower_decode_gemv)."""
    from helmc.compiler.passes.lower_quantized_gpu import (GEMV_INT8_EPILOGUE_TUNING, GEMV_INT8_TUNING, GEMV_TUNING,
                                                           make_gpu_gemv_int8, make_gpu_gemv_quant)
    from helmc.schedules.gpu.gemv import make_gpu_gemv
    H, I, Q, KV = block.hidden, block.ffn, block.q_dim, block.kv_dim
    funcs, kernels = {}, []

    def add(weight_type, role, f):
        name = str(f.attrs["global_symbol"])
        funcs[name] = f
        kernels.append(KitKernel(weight_type, role, name))
    for t in FLOAT_TYPES:
        add(t, "qkv", make_gpu_gemv(1, (Q, KV, KV), H, t))
        add(t, "o", make_gpu_gemv(1, H, Q, t))
        add(t, "swiglu", make_gpu_gemv(1, I, H, t, epilogue="swiglu"))
        add(t, "down", make_gpu_gemv(1, H, I, t, epilogue="residual"))
    for t in GPU_FUSED_TYPES[len(FLOAT_TYPES):]:
        add(t, "qkv", make_gpu_gemv_int8(t, (Q, KV, KV), H, *GEMV_INT8_TUNING[t]))
        add(t, "o", make_gpu_gemv_int8(t, H, Q, *GEMV_INT8_TUNING[t]))
        add(t, "swiglu", make_gpu_gemv_int8(t, I, H, *GEMV_INT8_EPILOGUE_TUNING[(t, "swiglu")], epilogue="swiglu"))
        add(t, "down", make_gpu_gemv_int8(t, H, I, *GEMV_INT8_EPILOGUE_TUNING[(t, "residual")], epilogue="residual"))
    for t in QUANT_TYPES:
        if t not in GPU_FUSED_TYPES:
            for role, (n, k) in block.linear_shapes().items():
                add(t, role, make_gpu_gemv_quant(t, n, k, *GEMV_TUNING[t]))
    return funcs, tuple(kernels)


def _target_profile(target: KitTarget) -> HardwareProfile:
    """The compile target as a HardwareProfile, for helmc's build pipeline; its rates are placeholders that no plan
    reads (the synthetic bundles' plans are given), said so in its notes."""
    cpu = CpuProfile(name="profile kit target", cores=target.cores, features=target.features,
                     l3_bytes=target.l3_bytes, dram_gbs=1.0, ram_total_bytes=1 << 40, ram_free_bytes=1 << 40)
    gpu = link = None
    if target.gpu_arch:
        gpu = GpuProfile(name="profile kit target", arch=target.gpu_arch, vram_total_bytes=1 << 40,
                         vram_free_bytes=1 << 40, hbm_gbs=1.0)
        link = LinkProfile(h2d_gbs=1.0, d2h_gbs=1.0, latency_us=0.0)
    return HardwareProfile(format_version=PROFILE_FORMAT_VERSION, cpu=cpu, gpu=gpu, link=link, source="profile-kit",
                           notes=("profile kit: a compile target only; no rate in it is measured",))


def build_kit(out_dir: str, target: KitTarget, cache_dir: str | None = None, progress=lambda m: None,
              stages: bool = True) -> ProfileKit:
    """Compile the kit for `target` into out_dir (created); stages=False: the kernels only (no synthetic bundles,
    so no per-block overheads can be measured with it)."""
    with frames_of_no_module_remembered():              # TVMScript's kernels parse without rescans
        return _build_kit(out_dir, target, cache_dir, progress, stages)


def _build_kit(out_dir: str, target: KitTarget, cache_dir: str | None, progress, stages: bool) -> ProfileKit:
    import tvm
    from helmc.compiler.passes.schedule_cpu_stage import llvm_target
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.stream_read import make_stream_read, stream_read_elements

    isa = select_isa(target.features)
    os.makedirs(out_dir, exist_ok=True)
    funcs, kernels = _kernels(target, isa)
    read_bytes = QUICK_READ_BYTES if target.quick else max(READ_MIN_BYTES, 4 * target.l3_bytes)
    read_n = stream_read_elements(read_bytes, isa)
    l3_n = stream_read_elements(max(1 << 20, target.l3_bytes // 2), isa)
    from helmc.schedules.cpu.gemm import make_gemm
    gemm = make_gemm(target.block.ffn, target.block.hidden, "float16", isa)
    funcs[str(gemm.attrs["global_symbol"])] = gemm
    from helmc.schedules.cpu.decode_attention import default_max_splits, make_decode_attention
    b = target.block
    attention = make_decode_attention(b.heads, b.kv_heads, b.head_dim, "float16", isa,
                                      default_max_splits(target.cores, b.kv_heads))
    funcs[str(attention.attrs["global_symbol"])] = attention
    funcs["helmc_stream_read"] = make_stream_read(read_n, isa)
    funcs["helmc_stream_read_l3"] = make_stream_read(l3_n, isa).with_attr("global_symbol", "helmc_stream_read_l3")
    progress(f"profile kit: compiling {len(funcs)} kernels for {isa.tier}")
    lib = tvm.compile(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in funcs.items()}),
                      target=llvm_target(target.features))
    lib.export_library(os.path.join(out_dir, KERNELS_LIB))
    gpu_kernels = ()
    if not stages:
        target = dataclasses.replace(target, gpu_arch="")
    else:
        _build_stages(out_dir, target, cache_dir, progress)
        if target.gpu_arch:
            progress(f"profile kit: the GPU decode GEMVs of every weight type for {target.gpu_arch}")
            gpu_kernels = build_gpu_gemv_kernels(out_dir, target.block, target.gpu_arch)
    kit = ProfileKit(format_version=KIT_FORMAT_VERSION, isa=isa.tier, required_flags=tuple(isa.required_flags),
                     l3_bytes=target.l3_bytes, cores=target.cores, block=target.block, read_elements=read_n,
                     l3_read_elements=l3_n, read_name="helmc_stream_read", l3_read_name="helmc_stream_read_l3",
                     kernels=tuple(kernels), gemm_name=str(gemm.attrs["global_symbol"]),
                     attention_name=str(attention.attrs["global_symbol"]),
                     cpu_bundle="cpu_bundle" if stages else "",
                     gpu_bundle="gpu_bundle" if target.gpu_arch else "",
                     gpu_arch=target.gpu_arch, synthetic_layers=target.layers, quick=target.quick,
                     gpu_gemv_kernels=gpu_kernels)
    kit.save(out_dir)
    return kit


def _build_stages(out_dir: str, target: KitTarget, cache_dir: str | None, progress) -> None:
    """The synthetic model's bundles, all on the CPU and (for a GPU arch) all on the GPU, built as helmc build
    builds any model; its weights are written at measure time."""
    from helmc.compiler.pipeline import build
    from helmc.runtime.bundle.plan import Plan, all_cpu_plan
    hw = _target_profile(target)
    with tempfile.TemporaryDirectory(prefix="helmc-synthetic-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(target.block.hf_config(target.layers), f)
        progress(f"profile kit: the synthetic model's CPU stage ({target.layers} blocks of "
                 f"{target.block.hidden}x{target.block.ffn})")
        build(model_dir, hw, os.path.join(out_dir, "cpu_bundle"), plan=all_cpu_plan(target.layers, 1024),
              cache_dir=cache_dir, quiet=True)
        if target.gpu_arch:
            progress(f"profile kit: the synthetic model's GPU stage for {target.gpu_arch}")
            gpu_plan = Plan.of(num_layers=target.layers, cpu_units=0, max_context=1024)
            build(model_dir, hw, os.path.join(out_dir, "gpu_bundle"), plan=gpu_plan, cache_dir=cache_dir, quiet=True)


def ensure_kit(target: KitTarget, cache_dir: str | None = None, use_cache: bool = True,
               progress=lambda m: None) -> str:
    """The kit for `target` from the artifact cache, built and stored there first if absent; returns its dir."""
    try:
        import tvm  # noqa: F401
        from tvm import relax  # noqa: F401
    except ImportError as e:
        raise HelmcError(f"helmc profile compiles its kernels with the TVM compiler, found none here ({e}); install "
                         f"helmc[compile], or measure with a kit built elsewhere: helmc profile --kit DIR") from None
    cache = ArtifactCache(cache_dir, enabled=use_cache)
    # "gpu-gemv": newer kits also hold the GPU decode GEMVs (a cached older kit would lack them)
    key = cache_key("profile-kit", f"kit-{KIT_FORMAT_VERSION}-gpu-gemv",
                    json.dumps(dataclasses.asdict(target), sort_keys=True))
    hit = cache.lookup(key)
    if hit:
        try:
            ProfileKit.load(hit)                       # an entry written by another helmc: rebuilt, never half-read
            progress(f"profile kit: reusing {os.path.relpath(hit)}")
            return hit
        except HelmcError:
            pass
    with tempfile.TemporaryDirectory(prefix="helmc-kit-") as work:
        kit_dir = os.path.join(work, "kit")
        build_kit(kit_dir, target, cache_dir=cache.root, progress=progress)
        return cache.store_tree(key, kit_dir, {"target": dataclasses.asdict(target)})



def copy_kit(out_dir: str, target: KitTarget, cache_dir: str | None = None, use_cache: bool = True,
             progress=lambda m: None) -> ProfileKit:
    """The kit for `target` in out_dir: ensure_kit's (from the artifact cache, built and stored there first if
    absent), its files copied; with use_cache=False built in out_dir, the cache neither read nor written."""
    if not use_cache:
        return build_kit(out_dir, target, cache_dir=cache_dir, progress=progress)
    entry = ensure_kit(target, cache_dir=cache_dir, progress=progress)
    with open(os.path.join(entry, "meta.json")) as f:
        names = json.load(f)["sha256"]                 # the kit's files, as the cache entry stored them
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
        shutil.copy2(os.path.join(entry, name), os.path.join(out_dir, name))
    return ProfileKit.load(out_dir)
