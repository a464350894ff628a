"""`helmc serve` (an OpenAI-compatible server): a thin click layer over helmc.api.serve; needs the `serve` extra
(pip install 'helmc[serve]'). `helmc chat` is in chat.py."""
from __future__ import annotations

import click

from helmc.api import ServeOptions
from helmc.cli.options import weights_option
from helmc.cli.trust import plan_option, trust_options
from helmc.cli.extras import RUNTIME, need

_SERVE = ServeOptions()


@click.command("serve")
@click.argument("bundle_dir", type=click.Path())
@click.option("--host", default=_SERVE.host, show_default=True)
@click.option("--port", type=int, default=_SERVE.port, show_default=True, help="0: any free port (printed when listening)")
@click.option("--max-batch", type=int, default=_SERVE.max_batch, help="sequences decoded at once [default: what the plan was made for]")
@click.option("--model-name", default=_SERVE.model_name, help="the model id clients send [default: the bundle directory's name, less .bundle]")
@weights_option
@click.option("--kv-page-tokens", type=int, default=_SERVE.kv_page_tokens, show_default=True)
@click.option("--log-level", default=_SERVE.log_level, show_default=True)
@plan_option
@trust_options
def serve_command(bundle_dir, host, port, max_batch, model_name, weights_dir, kv_page_tokens, log_level, plan_file,
                  trust, require_signed):
    """Serve BUNDLE_DIR over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from helmc import api
    api.runtime_only()
    need(*RUNTIME)
    options = ServeOptions(host=host, port=port, max_batch=max_batch, model_name=model_name, weights_dir=weights_dir,
                           kv_page_tokens=kv_page_tokens, log_level=log_level, plan=plan_file, trust=tuple(trust),
                           require_signed=require_signed)

    def ready(up):
        click.echo(f"helmc serve: listening on http://{up.host}:{up.port} (model {up.model_name!r}, max batch "
                   f"{up.max_batch}, context {up.max_context}, chat template {'yes' if up.chat_template else 'none'})",
                   err=True)

    def warn(refused):
        click.echo(f"helmc serve: warning: {refused}; chat requests get a 400, completions are served", err=True)
    api.serve(bundle_dir, options, on_ready=ready, on_warning=warn)
