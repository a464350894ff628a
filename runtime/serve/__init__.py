"""Serving a bundle: the OpenAI-compatible server, its scheduler, the batched engine and chat templates.

    engine, template = load_engine("bundle/", max_batch=8)      # session + one KV cache per batch slot
    helmc.runtime.serve.server.serve(ServeState(engine, ...), host, port)

Needs the `serve` extra (starlette, uvicorn, jinja2, prometheus_client) besides the runtime's own packages.
"""
