"""`helmc serve` (an OpenAI-compatible server): a thin click layer over helmc.runtime.serve; needs the `serve` extra
(pip install 'helmc[serve]'). `helmc chat` is in chat.py."""
from __future__ import annotations

import os

import click

from helmc.api import KV_PAGE_TOKENS
from helmc.cli.options import weights_option
from helmc.cli.trust import plan_option, read_plan, trust_options, trust_policy
from helmc.cli.extras import RUNTIME, need
from helmc.errors import HelmcError


def _need_serve_extra():
    """Import the serve extra's packages now, before any loading: one that is missing stops the command with the
    line naming the extra (helmc/cli/extras.py, through main's error handling)."""
    import jinja2  # noqa: F401
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401


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
@weights_option
@click.option("--kv-page-tokens", type=int, default=KV_PAGE_TOKENS, show_default=True)
@click.option("--log-level", default="warning", show_default=True)
@plan_option
@trust_options
def serve_command(bundle_dir, host, port, max_batch, model_name, weights_dir, kv_page_tokens, log_level, plan_file,
                  trust, require_signed):
    """Serve BUNDLE_DIR over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from helmc.runtime.isolation import forbid_compiler_imports
    forbid_compiler_imports()
    need(*RUNTIME)
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
