"""The CPU stage of a bundle: its blocks' weights bound on the host, their KV cache, and the head when the
plan keeps it on the CPU. Used by Session for an all-CPU plan and by gpu_session for a split one."""
from __future__ import annotations

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan
from helmc.runtime.kv.options import KVOptions
from helmc.runtime.progress import Progress
from helmc.runtime.weights.safetensors_mmap import Checkpoint

CPU_STAGE_LIB = "cpu_stage.so"


_LOADERS: dict[bool, Progress] = {}


def loader_progress(quiet: bool) -> Progress:
    """The one Progress of loading a bundle (phase lines and the weight-binding bar; silent when quiet)."""
    return _LOADERS.setdefault(bool(quiet), Progress(quiet))


def progress(msg: str, quiet: bool):
    loader_progress(quiet)(msg)


def load_stage_library(bundle_dir: str, manifest, name: str, dev=None, load=None):
    """A VirtualMachine over the bundle's stage library `name` on `dev` (default the CPU), loaded from the bytes
    the verified `manifest` names (bundle.library.verified_library: not from the path, which may have changed
    since); `load(path)` makes the module (default bundle.library.load_library; the GPU stage's loader registers
    its kernels first). Anything but a helmc stage library (a library without the VM's entry points, a file of
    another platform) is a HelmcError, not a TVM traceback."""
    import tvm.runtime
    from tvm.runtime.vm import VirtualMachine
    from helmc.runtime.bundle.library import load_library, verified_library
    try:
        with verified_library(bundle_dir, manifest, name) as path:
            module = (load or load_library)(path)
        return VirtualMachine(module, tvm.cpu() if dev is None else dev)
    except HelmcError:
        raise
    except (AttributeError, RuntimeError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HelmcError(f"bundle: {name} expected a helmc stage library (a TVM VM executable), found one that "
                         f"does not load as such ({first[:160]})") from None


def build_cpu_stage(vm, spec: ModelSpec, plan: Plan, checkpoint: Checkpoint, quiet: bool, bindings=None, layers=None,
                    kv: KVOptions = KVOptions()):
    """The CPU stage over `layers` (default plan.placement.cpu_layers; hybrid decode: plan.placement.cpu_compute_layers, the CPU groups'
    blocks) or None if there are none, and the head if it is on the CPU.
    `bindings`: the blocks' weights already on the host (pinned arenas for streamed prefill)."""
    pl, mem, wl = plan.placement, plan.memory, plan.workload
    import tvm.runtime
    from helmc.runtime.kv.cache_cpu import KVCacheCPU, default_threads, find_decode_kernel
    from helmc.runtime.tvm_tensors import (available_cpu_count, cpu_tensor_view, host_view, single_threaded_blas,
                                          use_cpu_threads)

    use_cpu_threads(available_cpu_count())     # TVM otherwise uses half the cores on x86
    single_threaded_blas()                     # KV attention threads its own NumPy calls
    from helmc.runtime.stage import Stage, batch_phase, decode_batch_sizes
    from helmc.runtime.weights.bind import bind_head, bind_layers, layer_sinks

    dev = tvm.cpu()
    batches = decode_batch_sizes(wl.batch)      # the bundle's batched decode variants (import_relax)
    layers = pl.cpu_layers if layers is None else layers
    stage = None
    if len(layers):
        if bindings is None:
            bindings = bind_layers(checkpoint, spec, layers, dev, loader_progress(quiet))
        kv = KVCacheCPU(num_layers=len(layers), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                        page_tokens=kv.page_tokens, max_tokens=mem.max_context,
                        dtype=spec.dtype, sliding_window=tuple(spec.layer_window(i) for i in layers),
                        threads=default_threads(), sinks=layer_sinks(checkpoint, spec, layers),
                        attend_kernel=find_decode_kernel(vm.module, spec.num_heads, spec.num_kv_heads,
                                                         spec.head_dim, spec.dtype))
        # Views both ways, no copies: the K/V rows are copied into the pages by append, the attention's output is a
        # fresh array per call (KVCacheCPU.attend), read by post_attn before anything writes it again.
        stage = Stage("cpu", vm, spec, layers, kv, bindings, to_array=host_view,
                      from_array=lambda a: cpu_tensor_view(a, dev), batch_sizes=batches)
    head = None
    if not pl.head_on_gpu:
        hw = bind_head(checkpoint, spec, dev)
        fns = {p: vm[f"head_{p}"] for p in ("prefill", "decode") + tuple(batch_phase(b) for b in batches)}

        def head(x, phase, all_logits):
            if not all_logits and x.shape[0] > 1:
                x = tvm.runtime.tensor(x.numpy()[-1:], dev)           # [S, H] -> [1, H]: only the last row samples
                phase = "decode"
            return fns[phase](x, *hw).numpy()
    return stage, head
