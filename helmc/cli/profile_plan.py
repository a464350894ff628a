"""`helmc profile` and `helmc plan`: thin click commands over helmc.api.profile / build_kit and helmc.api.plan;
helmc/cli/main.py registers them (its group turns a HelmcError into one line).
"""
from __future__ import annotations

import json
import os
import tempfile

import click

from helmc.api import PLAN_DEFAULTS
from helmc.errors import HelmcError

GIB = 1024 ** 3


def summarize_profile(hw) -> str:
    """A HardwareProfile as the lines `helmc profile` prints."""
    c = hw.cpu
    reads = ", ".join(f"{r.weight_type}{f' x{r.rows}' if r.rows > 1 else ''} {r.gbs:.1f}" for r in c.gemv_reads)
    lines = [f"cpu: {c.name}, {c.cores} cores / {c.threads} threads, L3 {c.l3_bytes / 2**20:.0f} MiB, "
             f"RAM {c.ram_free_bytes / GIB:.1f} of {c.ram_total_bytes / GIB:.1f} GiB free",
             f"     DRAM {c.dram_gbs:.1f} GB/s (helmc's stream read), helmc's decode GEMVs read {c.host_read_gbs:.1f} GB/s "
             f"(fp16; the cost model's M), L3 {c.l3_gbs:.1f} GB/s, GEMM {c.fp32_gflops:.0f} GFLOP/s; "
             f"avx2 {c.has('avx2')}, f16c {c.has('f16c')}, avx512f {c.has('avx512f')}"]
    if reads:
        lines.append(f"     GEMV reads by weight type (GB/s): {reads}")
    stage = (f"; helmc's CPU stage read its blocks' weights at {c.stage_read_gbs:.1f} GB/s (synthetic blocks, every "
             f"part of a decode step)" if c.stage_read_gbs else "")
    per = (f" per {c.overhead_block_bytes / 2**20:.1f} MiB block (charged by a block's bytes)"
           if c.overhead_block_bytes and c.block_overhead_ms is not None else "")
    lines.append(f"     per-block overhead {_ms(c.block_overhead_ms)}{per}, per-token tail {_ms(c.step_overhead_ms)}{stage}")
    if hw.gpu is not None and hw.link is not None:
        g, l = hw.gpu, hw.link
        lines += [f"gpu: {g.name} ({g.arch}), VRAM {g.vram_free_bytes / GIB:.1f} of {g.vram_total_bytes / GIB:.1f} GiB free, "
                  f"HBM {g.hbm_gbs:.0f} GB/s, fp16 {g.fp16_tflops:.1f} TFLOP/s; per-block overhead "
                  f"{_ms(g.block_overhead_ms)}, per-token tail {_ms(g.step_overhead_ms)}",
                  f"link: H2D {l.h2d_gbs:.1f} GB/s, D2H {l.d2h_gbs:.1f} GB/s, latency {l.latency_us:.1f} us"]
        if g.gemv_reads:
            lines.insert(-1, "     helmc's GPU GEMV reads by weight type (GB/s): "
                         + ", ".join(f"{r.weight_type} {r.gbs:.0f}" for r in g.gemv_reads))
        if l.has_concurrent:
            lines.append(f"DRAM + PCIe at once: the GEMVs {l.cpu_read_concurrent_gbs:.1f} GB/s + copies "
                         f"{l.h2d_concurrent_gbs:.1f} GB/s = {l.combined_gbs:.1f} GB/s of host memory")
    if hw.block_overhead_ms:
        lines.append(f"profile-wide per-block overhead {hw.block_overhead_ms:.3f} ms (devices without their own)")
    lines += [f"unmeasured: {u}" for u in hw.unmeasured]
    lines += [f"warning: doubtful figure: {d}" for d in hw.doubtful]
    return "\n".join(lines)


def _ms(value) -> str:
    return "not measured" if value is None else f"{value:+.3f} ms"


@click.command("profile")
@click.option("-o", "--output", default="hardware.json", show_default=True, help="where to write the profile")
@click.option("--quick", is_flag=True, help="small buffers and a small block (seconds; figures not fit for planning)")
@click.option("--gpu-backend", type=click.Choice(["cupy", "torch", "none"]), default=None,
              help="force a GPU backend (default: cupy, else torch)")
@click.option("--kit", "kit_dir", type=click.Path(), default=None,
              help="measure with this profile kit (built elsewhere by --build-kit): no compiler needed here")
@click.option("--build-kit", "build_kit_dir", type=click.Path(), default=None,
              help="only build a profile kit into this directory (for --for's machine, default this one; "
                   "one the artifact cache holds is copied)")
@click.option("--for", "for_hardware", type=click.Path(), default=None,
              help="with --build-kit: a hardware.json or preset of the machine the kit is for")
@click.option("--no-overheads", is_flag=True, help="skip the per-block overheads on the kit's compiled stages")
def profile_command(output: str, quick: bool, gpu_backend: str | None, kit_dir: str | None, build_kit_dir: str | None,
                    for_hardware: str | None, no_overheads: bool) -> None:
    """Measure this machine's CPU, GPU and link with the code helmc runs on them."""
    from helmc import api
    if for_hardware and not build_kit_dir:
        raise HelmcError("--for expected with --build-kit, found it alone")
    if build_kit_dir:
        _echo_kit(api.build_kit(build_kit_dir, for_hardware, quick=quick, gpu_backend=gpu_backend))
        return
    hw = api.profile(quick=quick, gpu_backend=gpu_backend, kit_dir=kit_dir, overheads=not no_overheads)
    hw.save(output)
    click.echo(summarize_profile(hw))
    click.echo(f"wrote {output}")


def _echo_kit(built) -> None:
    kit, target, out_dir = built.kit, built.target, built.out_dir
    click.echo(f"built a profile kit in {out_dir}: {kit.isa} kernels for {target.cores} cores, L3 "
               f"{target.l3_bytes >> 20} MiB{', GPU stage for ' + target.gpu_arch if target.gpu_arch else ''}; "
               f"measure there with: helmc profile --kit {out_dir}  (or python -m helmc.hardware.measure --kit ...)")


def plot_plan(plan, path: str) -> None:
    """Predicted T_plan against k, the infeasible splits shaded, the chosen one marked (Figure 4.4)."""
    pl, pr, wl = plan.placement, plan.predictions, plan.workload
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HelmcError("--plot needs matplotlib (pip install matplotlib), found it not installed") from None
    ks = [c.cpu_units for c in pr.candidates]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(ks, [c.t_plan_ms for c in pr.candidates], marker="o", ms=3, label="predicted T_plan")
    shaded = False
    for c in pr.candidates:
        if not c.feasible:
            ax.axvspan(c.cpu_units - 0.5, c.cpu_units + 0.5, color="red", alpha=0.15, lw=0,
                       label=None if shaded else "infeasible (memory)")
            shaded = True
    ax.plot([pl.cpu_units], [pr.t_plan_ms], marker="*", ms=14, color="black", ls="none",
            label=f"chosen {plan.describe()}: {pr.t_plan_ms:.1f} ms")
    ax.set_xlabel("k = partition units on the CPU")
    ax.set_ylabel("ms per token" if wl.objective == "decode" else "ms to first token")
    ax.set_title(f"partition search: {pl.num_layers} blocks, prompt {wl.prompt_len}, output {wl.output_len}, "
                 f"batch {wl.batch}")
    ax.legend(loc="best")
    fig.tight_layout()
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".png", dir=out_dir)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


@click.command("plan")
@click.argument("model", metavar="MODEL_DIR_OR_CONFIG_OR_BUNDLE")
@click.argument("hardware", metavar="HARDWARE_JSON_OR_PRESET")
@click.option("--prompt-len", default=None, type=int, help=f"[default: {PLAN_DEFAULTS.prompt_len}, or a bundle's]")
@click.option("--output-len", default=None, type=int, help=f"[default: {PLAN_DEFAULTS.output_len}, or a bundle's]")
@click.option("--batch", default=None, type=int, help=f"[default: {PLAN_DEFAULTS.batch}; a bundle's own, always]")
@click.option("--objective", type=click.Choice(["decode", "prefill"]), default=None,
              help=f"[default: {PLAN_DEFAULTS.objective}, or a bundle's]")
@click.option("--gpu-budget", type=float, default=None,
              help="use at most this many GiB of VRAM in all (the profile's runtime reserve included) [default: all, or "
                   "the VRAM a bundle's plan was made for]")
@click.option("--kv-offload/--no-kv-offload", default=None,
              help="keep KV of GPU blocks in pinned host pages [default: on, or a bundle's]")
@click.option("--stream-prefill/--no-stream-prefill", default=True, show_default=True,
              help="run the CPU blocks' prefill on the GPU, streaming each block's weights over PCIe")
@click.option("--hybrid/--no-hybrid", default=True, show_default=True,
              help="let decode stream some host blocks to the GPU while the CPU computes others, where that is "
                   "predicted faster (needs a profile with the DRAM + PCIe concurrent rates)")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="weight dtype (default: the checkpoint's)")
@click.option("--json", "as_json", is_flag=True, help="print the plan and all candidates as JSON")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="draw T_plan against k into a PNG")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="write the Plan JSON here")
def plan_command(model, hardware, prompt_len, output_len, batch, objective, gpu_budget, kv_offload, stream_prefill,
                 hybrid, dtype, as_json, plot, output) -> None:
    """Choose which partition units run on the CPU and which on the GPU. Given a bundle (a
    directory `helmc build` wrote), plan its model and workload again for HARDWARE (`helmc profile` on the machine
    it runs on): `-o plan.json`, then `helmc run|serve|chat BUNDLE --plan plan.json`, with no compiling."""
    from helmc import api
    r = api.plan(model, hardware, api.PlanOptions(
        prompt_len=prompt_len, output_len=output_len, batch=batch, objective=objective, gpu_budget_gib=gpu_budget,
        kv_offload=kv_offload, stream_prefill=stream_prefill, hybrid=hybrid, dtype=dtype))
    if plot:
        plot_plan(r.plan, plot)
    if output:
        r.save(output)
    click.echo(json.dumps(r.to_json_dict(), indent=2) if as_json else r.table())
