"""The helmc command line: a thin click layer over helmc.api.

Every HelmcError becomes one line on stderr and exit status 2, never a traceback. Any other exception is a
bug or a failure of the machine: one line naming it and the log file that holds its traceback, exit status 1;
`helmc --debug ...` (or HELMC_DEBUG=1) prints the traceback instead. A reader of stdout that goes away ends the
command quietly, status 141 (as SIGPIPE would).
"""
from __future__ import annotations

import _thread
import json
import os
import signal
import sys
import threading
import time
import traceback

import click

from helmc.cli.profile_plan import plan_command, profile_command
from helmc.cli.chat import chat_command
from helmc.cli.serve_chat import serve_command
from helmc.cli.options import CONTEXT, output_option, weights_option
from helmc.cli.trust import plan_option, trust_options
from helmc.api import BUILD_DEFAULTS as _BUILD, QUANT_CHOICES, CalibrateOptions, RunOptions
from helmc.cli.extras import RUNTIME, need
from helmc.errors import HelmcError

_RUN = RunOptions()


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HelmcError as e:
            click.echo(f"helmc: error: {e}", err=True)
            ctx.exit(2)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("helmc: interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            # Whoever read stdout went away (`helmc run ... | head -1`): stop quietly with the status of a tool
            # killed by SIGPIPE; stdout goes to /dev/null so the interpreter's last flush raises nothing either.
            _drop_stdout()
            ctx.exit(141)
        except ModuleNotFoundError as e:
            from helmc.cli.extras import missing_extra_message
            line = missing_extra_message(ctx.invoked_subcommand, e)
            if line is None:
                self._unexpected(ctx, e)
            click.echo(line, err=True)
            ctx.exit(2)
        except Exception as e:
            self._unexpected(ctx, e)

    @staticmethod
    def _unexpected(ctx, e: BaseException):
        """A bug or a failure of the machine: one line and a log file with the traceback (or it, with --debug)."""
        if _interrupted(e):
            # Ctrl-C inside native code (TVM's compiler, LLVM) comes back wrapped in the library's own error.
            click.echo("helmc: interrupted", err=True)
            ctx.exit(130)
        if ctx.params.get("debug") or os.environ.get("HELMC_DEBUG") == "1":
            traceback.print_exc()
        else:
            where = _write_crash_log(ctx)
            click.echo(f"helmc: internal error: {type(e).__name__}: {_one_line(e)} in `helmc "
                       f"{ctx.invoked_subcommand or ''}` (traceback in {where}; rerun with --debug to see it)",
                       err=True)
        ctx.exit(1)


_SIGINT_SEEN: list[float] = []


# Python code that onnx's native library calls back into (the ONNX export and its checks): an exception raised
# there cannot cross the C++ frames below it (the binding aborts the whole process), so a Ctrl-C that lands in
# it is delivered again once the stack has left these modules.
_NATIVE_CALLBACK_MODULES = ("onnx", "onnx_ir", "onnxscript", "torch.onnx")
_SIGINT_RETRY_S = 0.05


def _under_native_callbacks(frame) -> bool:
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if any(name == m or name.startswith(m + ".") for m in _NATIVE_CALLBACK_MODULES):
            return True
        frame = frame.f_back
    return False


def _deliver_sigint_later() -> None:
    def later():
        time.sleep(_SIGINT_RETRY_S)
        _thread.interrupt_main()        # runs the SIGINT handler again in the main thread
    threading.Thread(target=later, name="helmc-sigint-retry", daemon=True).start()


def _on_sigint(signum, frame):
    _SIGINT_SEEN.append(time.monotonic())
    if _under_native_callbacks(frame):
        _deliver_sigint_later()
        return
    raise KeyboardInterrupt


def _watch_sigint() -> None:
    """Note every SIGINT (then raise KeyboardInterrupt as Python's own handler does), so an error that a native
    library made of it is still reported as an interruption."""
    _SIGINT_SEEN.clear()
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:          # not the main thread: nothing to watch
        pass


def _interrupted(e: BaseException) -> bool:
    """Whether e came of a Ctrl-C: a SIGINT was seen, or a KeyboardInterrupt is in its chain or its words."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt) or "KeyboardInterrupt" in str(e)[:2000]:
            return True
        e = e.__cause__ or e.__context__
    return bool(_SIGINT_SEEN)


def _drop_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):       # no real file behind stdout (an in-process runner): nothing to flush
        pass


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def _write_crash_log(ctx) -> str:
    """The traceback of the exception being handled, in a new file under HELMC_LOG_DIR (default
    ~/.cache/helmc/logs, else the temporary directory); returns its path."""
    import tempfile
    import time
    text = f"helmc {' '.join(sys.argv[1:])}\n\n{traceback.format_exc()}"
    for d in (os.environ.get("HELMC_LOG_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "helmc", "logs"),
              tempfile.gettempdir()):
        try:
            os.makedirs(d, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=time.strftime("helmc-%Y%m%d-%H%M%S-"), suffix=".log", dir=d)
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:   # argv may hold any bytes
                f.write(text)
            return path
        except OSError:
            continue
    return "no log file (could not write one; rerun with --debug)"


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(package_name="helmc")
@click.option("--debug", is_flag=True, help="show the traceback of an unexpected error")
def main(debug):
    """helmc: compile a Hugging Face model for one CPU + one GPU, and run it."""
    _watch_sigint()


@main.command("build")
@click.argument("model_dir", type=click.Path())
@click.argument("hardware", type=click.Path())
@output_option("out_dir", "bundle directory to write", old_out=True, required=True, type=click.Path())
@click.option("--gpu-budget", type=float, default=None, help="cap the plan's VRAM at this many GiB")
@click.option("--copy-weights", is_flag=True, help="copy the safetensors into the bundle")
@click.option("--no-cache", is_flag=True, help="rebuild even if artifacts/ has this build")
@click.option("--prompt-len", type=int, default=_BUILD.prompt_len, show_default=True,
              help="workload the plan optimises for")
@click.option("--output-len", type=int, default=_BUILD.output_len, show_default=True)
@click.option("--stream-prefill/--no-stream-prefill", default=_BUILD.stream_prefill, show_default=True,
              help="run the CPU blocks' prefill on the GPU, streaming each block's weights over PCIe")
@click.option("--prefill-activations", type=click.Choice(["model", "fp32"]), default=_BUILD.prefill_activations,
              show_default=True,
              help="AMX prefill GEMM inputs: rounded to the model's bf16 (as HF's bf16 model; fastest) or fp32 "
                   "(bf16 hi + lo, ~1e-5 of an fp32 GEMM, 1.3-1.6x the GEMM time)")
@click.option("--quant", type=click.Choice(QUANT_CHOICES), default=None,
              help="quantize a Hugging Face checkpoint's linear weights to this llama.cpp block format (once, into "
                   "the weights cache); a GGUF file keeps its own types")
@click.option("--max-batch", type=int, default=_BUILD.batch, show_default=True,
              help="sequences `helmc serve` decodes at once: the plan counts their KV and activations")
@click.option("--hybrid/--no-hybrid", default=_BUILD.hybrid, show_default=True,
              help="allow hybrid decode (host blocks in CPU groups and streamed groups) where the plan predicts it "
                   "faster; one sequence at a time, with --stream-prefill")
@click.option("--sign", "sign_key", default=None, type=click.Path(),
              help="sign the bundle's manifest with this private key (from `helmc keygen`)")
def build_cmd(model_dir, hardware, out_dir, gpu_budget, copy_weights, no_cache, prompt_len, output_len, stream_prefill,
              prefill_activations, quant, max_batch, hybrid, sign_key):
    """Compile MODEL_DIR (a Hugging Face directory or a GGUF file) for the machine described by HARDWARE
    (hardware.json) into a bundle."""
    need("tvm", "numpy")
    from helmc import api
    options = api.BuildOptions(copy_weights=copy_weights, use_cache=not no_cache, prompt_len=prompt_len,
                               output_len=output_len, stream_prefill=stream_prefill,
                               prefill_activations=prefill_activations, quant=quant or _BUILD.quant, batch=max_batch,
                               hybrid=hybrid)
    r = api.build(model_dir, hardware, out_dir, gpu_budget_gib=gpu_budget, sign_key=sign_key, options=options)
    click.echo(api.plan_table(r.plan, r.spec))
    reused = f" (reused cached: {', '.join(r.cache_hits)})" if r.cache_hits else ""
    click.echo(f"bundle written to {r.bundle_dir} in {r.seconds:.1f}s{reused}")


def _parse_ids(text: str | None):
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise HelmcError(f"--prompt-ids expected comma-separated integers, found {text!r}") from None


@main.command("run")
@click.argument("bundle_dir", type=click.Path())
@click.option("--prompt", default=None, help="prompt text (tokenized with the bundle's tokenizer)")
@click.option("--prompt-ids", default=None, help="prompt as token ids, e.g. 1,2,3")
@click.option("--max-new-tokens", type=int, default=_RUN.max_new_tokens, show_default=True)
@click.option("--temperature", type=float, default=_RUN.temperature, show_default=True, help="0 is greedy")
@click.option("--top-k", type=int, default=_RUN.top_k, show_default=True)
@click.option("--top-p", type=float, default=_RUN.top_p, show_default=True)
@click.option("--seed", type=int, default=_RUN.seed)
@weights_option
@click.option("--kv-page-tokens", type=int, default=_RUN.kv_page_tokens, show_default=True)
@click.option("--kv-watermark", type=float, default=_RUN.kv_watermark, show_default=True)
@click.option("--no-kv-offload", is_flag=True, help="keep all KV of GPU layers on the GPU")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object at the end")
@plan_option
@trust_options
def run_cmd(bundle_dir, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, weights_dir,
            kv_page_tokens, kv_watermark, no_kv_offload, as_json, plan_file, trust, require_signed):
    """Generate text from a bundle."""
    from helmc import api
    api.runtime_only()
    need(*RUNTIME)
    ids = _parse_ids(prompt_ids)
    if (prompt is None) == (ids is None):
        raise HelmcError("run: expected exactly one of --prompt or --prompt-ids")
    options = RunOptions(weights_dir=weights_dir, trust=tuple(trust), require_signed=require_signed, plan=plan_file,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         kv_page_tokens=kv_page_tokens, kv_watermark=kv_watermark, kv_offload=not no_kv_offload,
                         quiet=as_json)
    stream = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    r = api.run(bundle_dir, prompt=prompt, prompt_ids=ids, options=options, on_text=stream)
    if as_json:
        click.echo(json.dumps(r.to_json_dict()))
    else:
        if not r.text:
            click.echo(" ".join(map(str, r.tokens)), nl=False)
        click.echo(f"\n[{len(r.tokens)} tokens, TTFT {r.ttft_ms:.1f} ms, decode {r.decode_tok_s:.2f} tok/s]", err=True)


@main.command("calibrate")
@click.argument("bundle_dir", type=click.Path())
@click.argument("hardware", type=click.Path())
@output_option("out_path", "calibrated hardware.json to write", old_out=True, required=True, type=click.Path())
@weights_option
@click.option("--steps", type=int, default=CalibrateOptions().steps,
              help="decode steps timed per device [default: the plan's output_len]")
@click.option("--json", "as_json", is_flag=True, help="print the fits as one JSON object")
@trust_options
def calibrate_cmd(bundle_dir, hardware, out_path, weights_dir, steps, as_json, trust, require_signed):
    """Time BUNDLE_DIR's decode step on this machine and write HARDWARE with per-device overheads."""
    from helmc import api
    api.runtime_only()
    need(*RUNTIME)
    options = CalibrateOptions(weights_dir=weights_dir, trust=tuple(trust), require_signed=require_signed, steps=steps)
    r = api.calibrate(bundle_dir, hardware, options)
    r.profile.save(out_path)
    click.echo(json.dumps(r.to_json_dict()) if as_json else r.summary())
    click.echo(f"wrote {out_path}", err=as_json)


@main.command("keygen")
@click.argument("key_file", type=click.Path())
def keygen_cmd(key_file):
    """Write a new ed25519 key pair for signing bundles: KEY_FILE (private, mode 0600) and KEY_FILE.pub."""
    from helmc import api
    pub = api.keygen(key_file)
    click.echo(f"wrote {key_file} (private; keep it secret) and {pub.source} (fingerprint {pub.fingerprint})")


main.add_command(profile_command, "profile")
main.add_command(plan_command, "plan")
main.add_command(serve_command, "serve")
main.add_command(chat_command, "chat")

if __name__ == "__main__":
    main()
