"""Serving a bundle: the OpenAI-compatible server, its scheduler, the batched engine and chat templates.

    engine, template = load_engine("bundle/", max_batch=8, compile_template=False)   # + one KV cache per slot
    renderer = render.RenderPool(template, engine.tokenizer, engine.model.max_context).start()
    server.serve(server.ServeState(engine, name, renderer, ...), server.bind(host, port))

Needs the `serve` extra (starlette, uvicorn, jinja2, prometheus_client) besides the runtime's own packages.
"""
