"""`helmc serve` (an OpenAI-compatible server) and `helmc chat` (a terminal chat): thin click layers over
helmc.runtime.serve. Both need the `serve` extra (pip install helmc[serve])."""
from __future__ import annotations

import itertools
import os
import sys
import time

import click

from helmc.cli.trust import plan_option, read_plan, trust_options, trust_policy
from helmc.errors import HelmcError


def _need_serve_extra():
    missing = []
    for mod in ("starlette", "uvicorn", "jinja2", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise HelmcError(f"serve: expected the serve extra (pip install 'helmc[serve]'), found {', '.join(missing)} missing")


def _check_serve_arguments(port, max_batch, kv_page_tokens, log_level):
    """serve's arguments, checked before the bundle is read (a typo costs no load)."""
    if not 0 <= port <= 65535:
        raise HelmcError(f"--port expected in [0, 65535] (0: any free port), found {port}")
    if max_batch is not None and max_batch < 1:
        raise HelmcError(f"--max-batch expected >= 1 (or left out: the plan's batch), found {max_batch}")
    if kv_page_tokens < 1:
        raise HelmcError(f"--kv-page-tokens expected a positive integer, found {kv_page_tokens}")
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    if log_level not in levels:
        raise HelmcError(f"--log-level expected one of {', '.join(levels)}, found {log_level!r}")


@click.command("serve")
@click.argument("bundle_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0: any free port (printed when listening)")
@click.option("--max-batch", type=int, default=None, help="sequences decoded at once [default: what the plan was made for]")
@click.option("--model-name", default=None, help="the model id clients send [default: the bundle directory's name, less .bundle]")
@click.option("--weights", "weights_dir", default=None, type=click.Path(), help="model directory overriding the bundle's")
@click.option("--kv-page-tokens", type=int, default=512, show_default=True)
@click.option("--log-level", default="warning", show_default=True)
@plan_option
@trust_options
def serve_command(bundle_dir, host, port, max_batch, model_name, weights_dir, kv_page_tokens, log_level, plan_file,
                  trust, require_signed):
    """Serve BUNDLE_DIR over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from helmc.runtime.isolation import forbid_compiler_imports
    forbid_compiler_imports()
    _check_serve_arguments(port, max_batch, kv_page_tokens, log_level)
    _need_serve_extra()
    from helmc.runtime.serve.load import load_engine
    from helmc.runtime.serve.metrics import Metrics
    from helmc.runtime.serve.render import RenderPool
    from helmc.runtime.serve.server import ServeState, bind, serve
    policy = trust_policy(trust, require_signed)
    sock = bind(host, port)                                  # a busy port fails before the model loads
    metrics = Metrics()
    engine, template = load_engine(bundle_dir, max_batch, weights_dir, quiet=False, metrics=metrics, compile_template=False,
                                   kv_page_tokens=kv_page_tokens, plan=read_plan(plan_file), **policy)   # warm-up: stderr
    name = model_name or _model_id(bundle_dir)
    renderer = RenderPool(template, engine.tokenizer, engine.model.max_context).start()
    refused = renderer.check_template()
    if refused:
        click.echo(f"helmc serve: warning: {refused}; chat requests get a 400, completions are served", err=True)
    state = ServeState(engine, name, renderer, metrics, engine.model.spec.vocab_size)
    metrics.watch(engine)
    engine.start()

    def ready(actual_port):
        click.echo(f"helmc serve: listening on http://{host}:{actual_port} (model {name!r}, max batch "
                   f"{engine.model.max_batch}, context {engine.model.max_context}, chat template "
                   f"{'yes' if template and not refused else 'none'})", err=True)
    try:
        serve(state, sock, log_level, ready)
    finally:
        engine.stop()
        renderer.close()


def _model_id(bundle_dir: str) -> str:
    """The id clients send: the bundle directory's name without a trailing .bundle."""
    name = os.path.basename(os.path.normpath(bundle_dir))
    return name[:-len(".bundle")] if name.endswith(".bundle") and len(name) > len(".bundle") else name


@click.command("chat")
@click.argument("bundle_dir", type=click.Path())
@click.option("--system", default=None, help="a system message at the start of the conversation")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--weights", "weights_dir", default=None, type=click.Path(), help="model directory overriding the bundle's")
@plan_option
@trust_options
def chat_command(bundle_dir, system, max_new_tokens, temperature, top_p, top_k, seed, weights_dir, plan_file, trust,
                 require_signed):
    """Chat with BUNDLE_DIR in the terminal: tokens print as they come; /reset forgets the conversation,
    /stats shows the last reply's timings, /quit (or end of input) leaves."""
    from helmc.runtime.isolation import forbid_compiler_imports
    forbid_compiler_imports()
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise HelmcError("chat: expected jinja2 for the chat template (pip install 'helmc[serve]'), found it missing") from None
    from helmc.runtime.sampling import SamplingParams
    from helmc.runtime.serve.load import load_engine
    from helmc.runtime.serve.protocol import Request
    SamplingParams(temperature, top_k, top_p, seed, max_tokens=max_new_tokens)     # its checks, before any loading
    engine, template = load_engine(bundle_dir, 1, weights_dir, plan=read_plan(plan_file), **trust_policy(trust, require_signed))
    if template is None:
        raise HelmcError(f"chat: expected a chat template in {bundle_dir} (tokenizer_config.json or chat_template.jinja), "
                         "found none; use helmc run --prompt")
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    stats = "no reply yet"
    ids = itertools.count()
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo(">>> ", nl=False)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history = list(start)
            click.echo("[conversation cleared]")
            continue
        if line.strip() == "/stats":
            click.echo(f"[{stats}]")
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = engine.tokenizer.encode(template.render(history, add_generation_prompt=True),
                                             add_special_tokens=False).ids
            room = engine.model.max_context - len(prompt)
            params = SamplingParams(temperature, top_k, top_p, seed, max_tokens=max(1, min(max_new_tokens, room)))
            req = Request(f"chat-{next(ids)}", tuple(prompt), params)
            reply, last, t0 = [], [], time.perf_counter()
            stamps = []

            def sink(c):
                stamps.append(time.perf_counter())
                reply.append(c.text)
                sys.stdout.write(c.text)
                sys.stdout.flush()
                if c.finish_reason:
                    last.append(c)
            engine.submit(req, sink)
            while not last:
                engine.step()
        except HelmcError as e:
            history.pop()
            click.echo(f"helmc: error: {e} (/reset starts over)", err=True)
            continue
        click.echo("")
        c = last[0]
        if c.finish_reason == "error":
            history.pop()
            click.echo(f"helmc: error: {c.error}", err=True)
            continue
        history.append({"role": "assistant", "content": "".join(reply)})
        decode_s = stamps[-1] - stamps[0]
        rate = (c.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
        stats = (f"{c.completion_tokens} tokens ({c.finish_reason}), prompt {c.prompt_tokens} tokens, TTFT "
                 f"{1000 * (stamps[0] - t0):.1f} ms, decode {rate:.2f} tok/s, conversation {len(history)} messages")
