"""The model's chat template, rendered with jinja2 the way transformers' apply_chat_template renders it.

Where the template comes from (as transformers looks, in a bundle): chat_template.jinja (newer Hugging Face
checkpoints, and a GGUF file's `tokenizer.chat_template`, written there by the compiler), else
tokenizer_config.json's `chat_template` (a string, or a list of named templates: "default" is used). The
special tokens the templates read (bos_token, eos_token, ...) come from tokenizer_config.json.

Templates are code from the model's files: they run in jinja2's ImmutableSandboxedEnvironment with the
globals transformers gives them (raise_exception, strftime_now, namespace, dict) and its tojson filter.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime

from helmc.errors import HelmcError

TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            # transformers' {% generation %} marks assistant text for training masks; rendering ignores it
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

            def _render(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # jinja2's own tojson escapes HTML characters; transformers' does not
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class Namespace(jinja2.utils.Namespace):
            def __setitem__(self, name, value):       # no dunder attributes on a namespace (sandbox escapes)
                if isinstance(name, str) and name.startswith("_"):
                    raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")
                jinja2.utils.Namespace.__setitem__(self, name, value)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                           namespace=Namespace, dict=dict)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise HelmcError(f"chat template: expected a jinja2 template, found a syntax error at line {e.lineno}: "
                             f"{e.message}") from None
        self._errors = (jinja2.exceptions.TemplateError,)
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """The prompt text of `messages` (a list of {"role", "content", ...}); a template that refuses the
        conversation (raise_exception) is a HelmcError with its message."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=messages, tools=list(tools) if tools else None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except self._errors as e:
            raise HelmcError(f"chat template: {e}") from None


@dataclass(frozen=True)
class TemplateSource:
    """A chat template as read from the bundle, not yet compiled (the server compiles it in a worker process)."""
    source: str
    special_tokens: dict


def load_chat_template(bundle_dir: str, fallback_tokens: dict[str, str] | None = None) -> ChatTemplate | None:
    """The bundle's chat template with its special tokens, compiled, or None when the model has none.
    fallback_tokens: special tokens where tokenizer_config.json has none (a GGUF's bos/eos by id)."""
    t = read_chat_template(bundle_dir, fallback_tokens)
    return None if t is None else ChatTemplate(t.source, t.special_tokens)


def read_chat_template(bundle_dir: str, fallback_tokens: dict[str, str] | None = None) -> TemplateSource | None:
    """The bundle's chat template source with its special tokens, or None when the model has none."""
    config = {}
    path = os.path.join(bundle_dir, "tokenizer_config.json")
    if os.path.exists(path):
        with open(path) as f:
            try:
                config = json.load(f)
            except ValueError as e:
                raise HelmcError(f"{path}: expected JSON, found a parse error ({e})") from None
    source = None
    jinja_path = os.path.join(bundle_dir, TEMPLATE_FILE)
    if os.path.exists(jinja_path):
        with open(jinja_path) as f:
            source = f.read()
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        source = named.get("default")
    if not source:
        return None
    return TemplateSource(source, {**(fallback_tokens or {}), **special_tokens_of(config)})


def special_tokens_of(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (tokenizer_config.json stores each as a string or an AddedToken
    object with its text under "content")."""
    out = {}
    for name in _SPECIAL:
        v = config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out
