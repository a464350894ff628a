"""compile_gpu_stage: a Relax IRModule of the GPU stage -> host library + prebuilt cubin for one CUDA arch.

The target machine has no CUDA compiler and, in runtime-only TVM mode, no NVRTC. TVM built here (no
GPU driver) keeps the kernels as CUDA C++ source inside the host library and asks the global
`tvm_callback_cuda_compile(source)` for machine code when the library is loaded. So at build time we
take that source out, compile it with nvcc to a cubin for `arch`, and write an index mapping the
source's sha256 to the cubin; runtime/cuda_runtime.py registers a callback that answers from it.

nvcc runs WITHOUT --use_fast_math (TVM's own default): the exported RMSNorm computes pow(x, 2), and
fast-math powf of a negative base is NaN (device-notes, "fast-math NaN trap").

Before scheduling, every matmul is rewritten to read its 16-bit weight as stored (no separate cast
kernel) and to accumulate in fp32 (rewrite_matmuls_fp32_accumulate); this works for fp32 and for
fp16 activations. Scheduling: TVM's dlight GPU rules (decode GEMV, prefill matmul on its SIMT path,
RMSNorm, reductions, fallback); see _gpu_relax_pipeline and _simt_matmul_rule.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile

from helmc.errors import HelmcError
from helmc.jsonio import atomic_write_text

CUBIN_INDEX_FORMAT_VERSION = 1
SUPPORTED_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")

# Flags as TVM's own nvcc route (tvm.support.nvcc) minus --use_fast_math; see module docstring.
NVCC_FLAGS = (
    "-O3",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
)


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def rewrite_matmuls_fp32_accumulate(mod):
    """Every matmul reads 16-bit weights as stored and accumulates in fp32.

    1. matmul(x, [permute_dims](astype(w))) with w fp16/bf16 -> the same without the astype. The
       ONNX export of `F.linear(h, w.to(act))` casts the whole weight before the matmul; TVM would
       run that cast as its own kernel, writing and re-reading a converted copy of every weight on
       every step. Relax's matmul takes mixed input dtypes and, given an out_dtype, legalizes to
       `sum(out_dtype(x) * out_dtype(w))`, so the cast moves into the matmul's loads, exactly.
    2. out_dtype="float32" on every float matmul, then a cast back to its original dtype: without
       it an fp16 matmul sums in fp16 (relative error ~1e-2 at K = 4096 on CPU, device-notes),
       where cuBLAS, and so the HF reference, accumulates in fp32. The cast fuses into the matmul.
    FuseTransposeMatmul later folds each permute_dims into its matmul (one NT_matmul kernel).
    """
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    def matmul(rhs):
        x = wildcard()
        return x, is_op("relax.matmul")(x, rhs)

    w1, w2, w3, w4 = wildcard(), wildcard(), wildcard(), wildcard()
    cast1, cast2 = is_op("relax.astype")(w1), is_op("relax.astype")(w2)
    perm1, perm3 = is_op("relax.permute_dims")(cast1), is_op("relax.permute_dims")(w3)
    x1, pat1 = matmul(perm1)          # x @ permute_dims(astype(w))
    x2, pat2 = matmul(cast2)          # x @ astype(w)
    x3, pat3 = matmul(perm3)          # x @ permute_dims(w)
    x4, pat4 = matmul(w4)             # x @ y
    pattern = pat1 | pat2 | pat3 | pat4
    floats = ("float16", "bfloat16", "float32")
    narrow = ("float16", "bfloat16")

    def rewriter(expr, matches):
        out_dtype = expr.ty.dtype
        if out_dtype not in floats:
            return expr
        stripped = False
        if pat1 in matches and matches[w1].ty.dtype in narrow:
            x, rhs, stripped = matches[x1], relax.op.permute_dims(matches[w1], matches[perm1].attrs.axes), True
        elif pat2 in matches and matches[w2].ty.dtype in narrow:
            x, rhs, stripped = matches[x2], matches[w2], True
        else:
            x, rhs = expr.args
        if not stripped and (out_dtype == "float32" or expr.attrs.out_dtype == "float32"):
            return expr               # fp32 already, nothing to strip: also makes the rewrite idempotent
        new = relax.op.matmul(x, rhs, out_dtype="float32")
        return new if out_dtype == "float32" else relax.op.astype(new, out_dtype)

    out = mod
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out[gv] = rewrite_call(pattern, rewriter, func)
    return out


def _simt_matmul_rule():
    """dlight's Matmul rule restricted to its SIMT path.

    In apache-tvm 0.27.0.post1 the rule's tensor-core path (MatmulTensorization, WMMA) segfaults
    inside Schedule.tensorize for every fp16 matmul tried here (static or symbolic M, fp16 or fp32
    output), killing the compiler; and merely entering that path imports tvm.s_tir.tensor_intrin,
    which parses ~500 TVMScript functions and took 45-80 s in a process that has torch loaded. Its
    own opt-out (the "dlight.do_not_tensorize" function attribute) is checked only after that
    import, so the tensor-core class is swapped for one that declines, for the duration of apply.
    """
    from tvm.s_tir.dlight.gpu import matmul as matmul_module

    class _Declines:
        def apply(self, *_args):
            return None

    class SimtMatmul(matmul_module.Matmul):
        def apply(self, func, target, tunable):
            saved = matmul_module.MatmulTensorization
            matmul_module.MatmulTensorization = _Declines
            try:
                return super().apply(func, target, tunable)
            finally:
                matmul_module.MatmulTensorization = saved

    return SimtMatmul()


def _gpu_relax_pipeline(target):
    """TVM's CUDA default pipeline (tvm/relax/backend/cuda/pipeline.py) with more dlight rules.

    Rule order matters (first match wins): Matmul takes symbolic-seq prefill matmuls (SIMT, see
    _simt_matmul_rule), GEMV the seq=1 decode projections, LowBatchGEMV small static batches,
    RMSNorm / reductions the norms and means, Fallback everything element-wise.
    """
    import tvm
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline
    from tvm.s_tir import dlight as dl

    legalize = [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(
            _simt_matmul_rule(),
            dl.gpu.GEMV(),
            dl.gpu.LowBatchGEMV(),
            dl.gpu.RMSNorm(),
            dl.gpu.Reduction(),
            dl.gpu.GeneralReduction(),
            dl.gpu.Fallback(),
        ),
    ]

    @tvm.transform.module_pass(opt_level=0, name="HelmcGpuStagePipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(
                cuda_pipeline.library_dispatch_passes(target)
                + legalize
                + cuda_pipeline.dataflow_lower_passes(target)
                + cuda_pipeline.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline


def _collect_cuda_sources(module) -> list[str]:
    """Every CUDA source module under the executable's imports (depth first, deduplicated)."""
    found, seen, stack = [], set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.kind == "cuda":
            found.append(m.inspect_source("cuda"))
        stack.extend(m.imports)
    return found


def compile_cuda_source(source: str, arch: str, out_path: str, nvcc: str | None = None,
                        defines: tuple[str, ...] = ()) -> None:
    """nvcc source -> cubin for `arch` (no fast math). Raises HelmcError with nvcc's output on failure."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise HelmcError("compile_gpu_stage: expected nvcc on PATH or in /usr/local/cuda/bin, found none")
    with tempfile.TemporaryDirectory(prefix="helmc-nvcc-") as tmp:
        src = os.path.join(tmp, "kernels.cu")
        with open(src, "w") as f:
            f.write(source)
        cubin_tmp = os.path.join(tmp, "kernels.cubin")
        gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
        cmd = [nvcc, "--cubin", gencode, *NVCC_FLAGS, *defines, "-o", cubin_tmp, src]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise HelmcError(f"compile_gpu_stage: nvcc failed for {arch} (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        shutil.move(cubin_tmp, out_path)


def _check_input(mod, arch: str) -> None:
    import tvm

    if arch not in SUPPORTED_ARCHS:
        raise HelmcError(f"compile_gpu_stage: expected a CUDA arch in {SUPPORTED_ARCHS}, found {arch!r}")
    if not isinstance(mod, tvm.IRModule):
        raise HelmcError(f"compile_gpu_stage: expected a tvm.IRModule, found {type(mod).__name__}")


def build_gpu_executable(mod, arch: str, fp32_accumulate: bool = True, host_mcpu: str | None = None,
                         weight_types: dict | None = None, fuse_norms: bool = True, prefill_cublas: bool = True,
                         merge_launches: bool = True, kernels: dict | None = None):
    """The GPU stage's Relax passes and TVM's build for CUDA `arch`, no nvcc: the VM executable, its kernels as
    CUDA source (kernel_launches reads what each function launches). merge_launches=False: the reference form, one
    launch per fp16 / bf16 decode linear, SwiGLU and the residual add apart, q's and k's norm + RoPE apart (the int8
    GEMVs keep their shared-x launches and epilogues). kernels: {global symbol: scheduled PrimFunc} the runtime
    calls by name (the MoE expert kernels), added as they are."""
    import tvm

    _check_input(mod, arch)
    host = {"kind": "llvm"} if host_mcpu is None else {"kind": "llvm", "mcpu": host_mcpu}
    # Static shared memory without opt-in is 48 KiB on every arch we build for; naming the limits
    # keeps dlight's choices independent of the build machine (which has no GPU to ask).
    target = tvm.target.Target({"kind": "cuda", "arch": arch, "max_shared_memory_per_block": 49152,
                                "max_threads_per_block": 1024, "thread_warp_size": 32}, host=host)
    if weight_types:        # quantized weights: raw blocks in, their own kernels (lower_quantized_gpu)
        from helmc.compiler.passes.lower_quantized_gpu import lower_quantized_gpu
        mod = lower_quantized_gpu(mod, weight_types)
    from helmc.compiler.passes.lower_decode_gemv import lower_decode_gemv
    # decode linears over fp16/bf16 weights: helmc's m-row GEMV (batch invariant), several per launch
    mod = lower_decode_gemv(mod, fuse=merge_launches)
    if fp32_accumulate:
        mod = rewrite_matmuls_fp32_accumulate(mod)
    if fuse_norms:          # RMSNorm, residual add + RMSNorm, q/k norm + RoPE: one kernel each
        from helmc.compiler.passes.fuse_gpu_norms import fuse_gpu_norms
        mod = fuse_gpu_norms(mod, one_launch_qk=merge_launches)
        if merge_launches:  # the decode norms folded into the GEMVs that read them
            from helmc.compiler.passes.fuse_gpu_norms import fuse_norm_gemv
            mod = fuse_norm_gemv(mod)
    if prefill_cublas:      # prefill linears on tensor cores: cuBLAS through the runtime's CuPy
        from helmc.compiler.passes.dispatch_prefill_gemm import dispatch_prefill_gemm
        mod = dispatch_prefill_gemm(mod)
    for name, func in (kernels or {}).items():
        mod[name] = func
    return tvm.compile(mod, target=target, relax_pipeline=_gpu_relax_pipeline(target))


def kernel_launches(ex) -> dict[str, list[str]]:
    """{VM function: the GPU launches it makes, in order} of build_gpu_executable's executable: its calls of
    PrimFuncs with CUDA kernels (one entry per kernel) and of the runtime's cuBLAS GEMM. The decode step's CUDA
    graph has one node per launch, so each launch costs ~1 us beside its work."""
    from helmc.compiler.passes.dispatch_prefill_gemm import GEMM_FUNC

    source = "\n".join(_collect_cuda_sources(ex.mod))
    kernels: dict[str, int] = {}
    for name in re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{', source):
        func = re.sub(r"_kernel\d*$", "", name)
        kernels[func] = kernels.get(func, 0) + 1
    launches: dict[str, list[str]] = {}
    func = None
    for line in ex.as_text().splitlines():
        if line.startswith("@") and line.endswith(":"):
            func = line[1:-1]
            launches[func] = []
        elif func and (call := re.match(r"\s*call\s+(\S+)\s+in:", line)):
            name = call.group(1)
            launches[func] += [name] * (kernels.get(name, 0) + (name == GEMM_FUNC))
    return launches


def compile_gpu_stage(mod, arch: str, out_dir: str, name: str = "gpu_stage",
                      fp32_accumulate: bool = True, host_mcpu: str | None = None,
                      weight_types: dict | None = None, fuse_norms: bool = True,
                      prefill_cublas: bool = True, merge_launches: bool = True,
                      kernels: dict | None = None) -> tuple[str, ...]:
    """Compile the GPU stage's Relax module for CUDA `arch`; returns the file names written into out_dir.

    Writes `<name>.so` (host code + VM bytecode, the CUDA source embedded), `<name>.<arch>.cubin`,
    `<name>.cubins.json` (`{"format_version", "arch", "nvcc_flags", "cubins": {sha256(source): cubin
    file}}`) and `<name>.cu` (the source, for reading).
    Load with `helmc.runtime.cuda_runtime.load_gpu_vm(so, json)` (or load_gpu_executable + VirtualMachine).
    """
    _check_input(mod, arch)
    nvcc = find_nvcc()
    if nvcc is None:
        raise HelmcError("compile_gpu_stage: expected nvcc on PATH or in /usr/local/cuda/bin, found none")
    ex = build_gpu_executable(mod, arch, fp32_accumulate, host_mcpu, weight_types, fuse_norms, prefill_cublas,
                              merge_launches, kernels)

    sources = _collect_cuda_sources(ex.mod)
    if len(sources) != 1:
        raise HelmcError(f"compile_gpu_stage: expected 1 CUDA source module in the build, found {len(sources)}")
    source = sources[0]

    os.makedirs(out_dir, exist_ok=True)
    so_name, cubin_name, index_name = f"{name}.so", f"{name}.{arch}.cubin", f"{name}.cubins.json"
    source_name = f"{name}.cu"   # for reading the kernels; not needed at run time
    # Everything is written under temporary names, then renamed: no half-written stage on failure.
    tmp_cubin, tmp_so = os.path.join(out_dir, f".tmp-{cubin_name}"), os.path.join(out_dir, f".tmp-{so_name}")
    try:
        compile_cuda_source(source, arch, tmp_cubin, nvcc)
        ex.export_library(tmp_so)
        index = {
            "format_version": CUBIN_INDEX_FORMAT_VERSION,
            "arch": arch,
            "nvcc_flags": list(NVCC_FLAGS),
            "cubins": {hashlib.sha256(source.encode("utf-8")).hexdigest(): cubin_name},
        }
        os.replace(tmp_cubin, os.path.join(out_dir, cubin_name))
        os.replace(tmp_so, os.path.join(out_dir, so_name))
        for fname, text in ((source_name, source), (index_name, json.dumps(index, indent=2) + "\n")):
            atomic_write_text(os.path.join(out_dir, fname), text)
            os.chmod(os.path.join(out_dir, fname), 0o644)    # the temp file was private; a bundle is not
    finally:
        for leftover in (tmp_cubin, tmp_so):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return (so_name, cubin_name, index_name, source_name)


def compile_paged_attention(head_dim: int, group: int, arch: str, out_dir: str) -> str:
    """The paged decode attention kernels (schedules/gpu/paged_attention.py, paged_decode_short.py) and the
    tensor-core prefill attention (schedules/gpu/flash_prefill.py, sm_80+) for one (head_dim, query group) and `arch` ->
    `out_dir/paged_attention.cubin`, which the runtime's CudaOps loads. Returns the file name."""
    from helmc.runtime.kv.cuda_ops import PAGED_ATTENTION_CUBIN
    from helmc.schedules.gpu.flash_prefill import FLASH_SOURCE
    from helmc.schedules.gpu.paged_attention import DECODE_SOURCE, kernel_defines
    from helmc.schedules.gpu.paged_decode_short import SHORT_SOURCE

    if arch not in SUPPORTED_ARCHS:
        raise HelmcError(f"compile_paged_attention: expected a CUDA arch in {SUPPORTED_ARCHS}, found {arch!r}")
    defines = kernel_defines(head_dim, group)
    tmp = os.path.join(out_dir, f".tmp-{PAGED_ATTENTION_CUBIN}")
    try:
        compile_cuda_source(DECODE_SOURCE + SHORT_SOURCE + FLASH_SOURCE, arch, tmp, defines=defines)
        os.replace(tmp, os.path.join(out_dir, PAGED_ATTENTION_CUBIN))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return PAGED_ATTENTION_CUBIN
