"""from_json/to_json for the frozen dataclasses that flow between layers.

Unknown keys are refused (a typo in hardware.json must not be silently ignored), missing required
keys are named, and tuples round-trip (JSON lists become tuples so the dataclasses stay hashable).
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import types
import typing
from typing import Any, TypeVar

from helmc.errors import HelmcError

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (tuple,):
        if not isinstance(value, (list, tuple)):
            raise HelmcError(f"{where}: expected a list, found {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is typing.Union or origin is types.UnionType:
        for a in args:
            if a is type(None):
                continue
            return _convert(a, value, where)
    if origin is dict:
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise HelmcError(f"{where}: expected {tp.__name__}, found {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type[T], data: Any, where: str | None = None) -> T:
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise HelmcError(f"{where}: expected a JSON object, found {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise HelmcError(f"{where}: unknown key(s) {unknown}; expected only {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise HelmcError(f"{where}: missing required key {name!r}")
    return cls(**kwargs)


def atomic_write_text(path: str, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_json_file(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HelmcError(f"{what}: file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise HelmcError(f"{what}: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
