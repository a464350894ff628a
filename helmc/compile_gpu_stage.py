"""compile_gpu_stage: a Relax IRModule of the GPU stage -> host library + prebuilt cubin for one CUDA arch.

The target machine has no CUDA compiler and, in runtime-only TVM mode, no NVRTC. TVM built here (no
GPU driver) keeps the kernels as CUDA C++ source inside the host library and asks the global
`tvm_callback_cuda_compile(source)` for machine code when the library is loaded. So at build time we
take that source out, compile it with nvcc to a cubin for `arch`, and write an index mapping the
source's sha256 to the cubin; runtime/cuda_runtime.py registers a callback that answers from it.

nvcc runs WITHOUT --use_fast_math (TVM's own default): the exported RMSNorm computes pow(x, 2), and
fast-math powf of a negative base is NaN (device-notes, "fast-math NaN trap").

Scheduling: TVM's dlight GPU rules (decode GEMV, prefill tensor-core matmul, RMSNorm, reductions,
fallback). When the module computes in fp32 with fp16 weights cast up inside the graph (what the
ONNX export of `F.linear(h, w.float())` gives), each such matmul is rewritten to take fp16 inputs
and accumulate in fp32: the weight is then read as fp16 (half the bytes of the upcast copy) and
prefill matmuls qualify for tensor cores, while everything between matmuls stays fp32.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile

from .errors import HelmcError
from .jsonio import atomic_write_text

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


def rewrite_fp16_weight_matmuls(mod):
    """matmul(x_f32, [permute_dims](astype(w_f16, f32))) -> matmul(astype(x, f16), [permute_dims](w), out_dtype=f32).

    Exact for the weight (f16 -> f32 -> f16 is lossless); rounds the activation to fp16 at the
    matmul input only (what HF does everywhere in an fp16 model), accumulation stays fp32.
    """
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    x_pat, w_pat = wildcard(), wildcard()
    cast_pat = is_op("relax.astype")(w_pat)
    perm_pat = is_op("relax.permute_dims")(cast_pat)
    pattern = is_op("relax.matmul")(x_pat, perm_pat) | is_op("relax.matmul")(x_pat, cast_pat)

    def rewriter(expr, matches):
        x, w = matches[x_pat], matches[w_pat]
        if w.ty.dtype != "float16" or x.ty.dtype != "float32":
            return expr
        if expr.ty.dtype != "float32":
            return expr
        if perm_pat in matches:
            rhs = relax.op.permute_dims(w, matches[perm_pat].attrs.axes)
        else:
            rhs = w
        return relax.op.matmul(relax.op.astype(x, "float16"), rhs, out_dtype="float32")

    out = mod
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out[gv] = rewrite_call(pattern, rewriter, func)
    return out


def _mark_prim_funcs_do_not_tensorize(mod, _ctx):
    """Keep dlight's Matmul rule on its SIMT path.

    In apache-tvm 0.27.0.post1 its tensor-core path (MatmulTensorization, WMMA) segfaults inside
    Schedule.tensorize for every fp16 matmul tried here (static or symbolic M, fp16 or fp32 output),
    killing the compiler process; the attribute below is dlight's own switch to skip that path.
    """
    from tvm import tirx

    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and "dlight.do_not_tensorize" not in func.attrs:
            mod[gv] = func.with_attr("dlight.do_not_tensorize", True)
    return mod


def _gpu_relax_pipeline(target):
    """TVM's CUDA default pipeline (tvm/relax/backend/cuda/pipeline.py) with more dlight rules.

    Rule order matters (first match wins): Matmul takes symbolic-seq prefill matmuls (tensor cores
    for fp16 inputs), GEMV the seq=1 decode projections, LowBatchGEMV small static batches,
    RMSNorm / reductions the norms and means, Fallback everything element-wise.
    """
    import tvm
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline
    from tvm.s_tir import dlight as dl

    mark_do_not_tensorize = tvm.transform.module_pass(
        _mark_prim_funcs_do_not_tensorize, opt_level=0, name="MarkDoNotTensorize")
    legalize = [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        mark_do_not_tensorize,
        dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(),
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


def compile_cuda_source(source: str, arch: str, out_path: str, nvcc: str | None = None) -> None:
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
        cmd = [nvcc, "--cubin", gencode, *NVCC_FLAGS, "-o", cubin_tmp, src]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise HelmcError(f"compile_gpu_stage: nvcc failed for {arch} (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        shutil.move(cubin_tmp, out_path)


def compile_gpu_stage(mod, arch: str, out_dir: str, name: str = "gpu_stage",
                      fp16_matmul_inputs: bool = True, host_mcpu: str | None = None) -> tuple[str, ...]:
    """Compile the GPU stage's Relax module for CUDA `arch`; returns the file names written into out_dir.

    Writes `<name>.so` (host code + VM bytecode, the CUDA source embedded), `<name>.<arch>.cubin`
    and `<name>.cubin.json` (`{"format_version", "arch", "cubins": {sha256(source): cubin file}}`).
    Load with `helmc.runtime.cuda_runtime.load_gpu_executable(so, json)`.
    """
    import tvm

    if arch not in SUPPORTED_ARCHS:
        raise HelmcError(f"compile_gpu_stage: expected a CUDA arch in {SUPPORTED_ARCHS}, found {arch!r}")
    if not isinstance(mod, tvm.IRModule):
        raise HelmcError(f"compile_gpu_stage: expected a tvm.IRModule, found {type(mod).__name__}")
    nvcc = find_nvcc()
    if nvcc is None:
        raise HelmcError("compile_gpu_stage: expected nvcc on PATH or in /usr/local/cuda/bin, found none")

    host = {"kind": "llvm"} if host_mcpu is None else {"kind": "llvm", "mcpu": host_mcpu}
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host=host)
    if fp16_matmul_inputs:
        mod = rewrite_fp16_weight_matmuls(mod)
    ex = tvm.compile(mod, target=target, relax_pipeline=_gpu_relax_pipeline(target))

    sources = _collect_cuda_sources(ex.mod)
    if len(sources) != 1:
        raise HelmcError(f"compile_gpu_stage: expected 1 CUDA source module in the build, found {len(sources)}")
    source = sources[0]

    os.makedirs(out_dir, exist_ok=True)
    so_name, cubin_name, index_name = f"{name}.so", f"{name}.{arch}.cubin", f"{name}.cubin.json"
    # Everything is written under temporary names, then renamed: no half-written stage on failure.
    compile_cuda_source(source, arch, os.path.join(out_dir, f".tmp-{cubin_name}"), nvcc)
    so_tmp = os.path.join(out_dir, f".tmp-{so_name}")
    ex.export_library(so_tmp)
    index = {
        "format_version": CUBIN_INDEX_FORMAT_VERSION,
        "arch": arch,
        "nvcc_flags": list(NVCC_FLAGS),
        "cubins": {hashlib.sha256(source.encode("utf-8")).hexdigest(): cubin_name},
    }
    os.replace(os.path.join(out_dir, f".tmp-{cubin_name}"), os.path.join(out_dir, cubin_name))
    os.replace(so_tmp, os.path.join(out_dir, so_name))
    atomic_write_text(os.path.join(out_dir, index_name), json.dumps(index, indent=2) + "\n")
    return (so_name, cubin_name, index_name)


def cuda_source_of(lib_path: str) -> str:
    """The CUDA source embedded in a built host library (for inspection and tests)."""
    import tvm

    sources = _collect_cuda_sources(tvm.runtime.load_module(lib_path))
    if len(sources) != 1:
        raise HelmcError(f"{lib_path}: expected 1 CUDA source module, found {len(sources)}")
    return sources[0]
