"""A bundle made ready to serve: its Session, one KV cache per batch slot, the engine, the chat template, EOS; warmed up
(every decode batch size run once, the slots' CPU KV committed: runtime/serve/warmup.py) and the cyclic GC's view
of what loading made frozen."""
from __future__ import annotations

import json
import os

from helmc.errors import HelmcError


def eos_token_ids(bundle_dir: str, spec) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an id or a list) when the bundle has one, else the model spec's."""
    path = os.path.join(bundle_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            try:
                eos = json.load(f).get("eos_token_id")
            except ValueError as e:
                raise HelmcError(f"{path}: expected JSON, found a parse error ({e})") from None
        if isinstance(eos, int) and not isinstance(eos, bool):
            return (eos,)
        if isinstance(eos, list) and eos and all(isinstance(t, int) for t in eos):
            return tuple(eos)
    return tuple(spec.eos_token_ids)


def load_engine(bundle_dir: str, max_batch: int | None = None, weights_dir: str | None = None, quiet: bool = True,
                metrics=None, trusted_keys: tuple | None = None, require_signed: bool = False, plan=None,
                warm_up: bool = True, compile_template: bool = True, **kv_options):
    """(Engine, ChatTemplate or None) for `bundle_dir`; max_batch defaults to the batch its plan was made for.
    trusted_keys, require_signed: as Session.load (the signature is checked before anything else is read);
    plan: a Plan run instead of the bundle's own (`--plan`). warm_up: run warmup.warm_up (its lines on stderr unless
    quiet) and freeze the GC (warmup.freeze_gc) before the engine takes requests. compile_template False: the
    template comes back as its source (chat_template.TemplateSource), for the server's render workers."""
    import sys
    from helmc.runtime.session import Session
    from helmc.runtime.serve.batch_model import BatchModel
    from helmc.runtime.serve.chat_template import load_chat_template, read_chat_template
    from helmc.runtime.serve.engine import Engine
    session = Session.load(bundle_dir, weights_dir=weights_dir, quiet=quiet, trusted_keys=trusted_keys,
                           require_signed=require_signed, plan=plan, **kv_options)
    model = BatchModel(session, max_batch or session.plan.workload.batch, kv_options.get("kv_watermark", 0.8))
    if warm_up:
        from helmc.runtime.serve import warmup
        warmup.warm_up(model, None if quiet else (lambda line: print("  " + line, file=sys.stderr, flush=True)))
    tok = session.tokenizer
    fallback = {}
    if tok is not None:                       # a GGUF bundle has no tokenizer_config.json: bos/eos by id
        for name, tid in (("bos_token", session.spec.bos_token_id), ("eos_token", (session.spec.eos_token_ids or (-1,))[0])):
            text = tok.id_to_token(tid) if tid >= 0 else None
            if text is not None:
                fallback[name] = text
    template = (load_chat_template if compile_template else read_chat_template)(bundle_dir, fallback)
    engine = Engine(model, tok, eos_token_ids(bundle_dir, session.spec), metrics)
    if warm_up:
        warmup.freeze_gc()
    return engine, template
