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


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _found(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:60]!r}"


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            return _convert(a, value, where)
    if value is None:
        raise HelmcError(f"{where}: expected {_type_name(tp)}, found null")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (tuple,):
        if not isinstance(value, (list, tuple)):
            raise HelmcError(f"{where}: expected a list, found {_found(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise HelmcError(f"{where}: expected a list of {len(args)}, found {len(value)} items")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise HelmcError(f"{where}: expected a JSON object, found {_found(value)}")
        return dict(value)
    if tp in (int, float) and isinstance(value, bool):
        raise HelmcError(f"{where}: expected {tp.__name__}, found {_found(value)}")
    if tp is float and isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            raise HelmcError(f"{where}: expected a float, found an integer too large for one") from None
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise HelmcError(f"{where}: expected {tp.__name__}, found {_found(value)}")
    return value


def parse_json(text: str | bytes, what: str) -> Any:
    """json.loads, every malformed input a HelmcError naming `what` (also nesting too deep to parse)."""
    try:
        return json.loads(text)
    except ValueError as e:           # JSONDecodeError, and UnicodeDecodeError for bytes
        raise HelmcError(f"{what}: expected valid JSON, found {getattr(e, 'msg', None) or type(e).__name__}"
                         f"{f' at line {e.lineno}' if hasattr(e, 'lineno') else ''}") from None
    except RecursionError:
        raise HelmcError(f"{what}: expected JSON of reasonable depth, found nesting too deep to parse") from None


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


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask would set it for a moment,
    process-wide, under other threads' feet)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~current_umask())      # mkstemp's 0600 would make a shared bundle unreadable to others
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def require_regular_file(path: str, what: str) -> os.stat_result:
    """os.stat of path (links followed) after checking it is a regular file: a FIFO, device, socket or directory is
    refused in one line before anything opens it."""
    import stat as st
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise HelmcError(f"{what}: file not found: {path}") from None
    except OSError as e:
        raise HelmcError(f"{what}: could not read {path} ({e.strerror or e})") from None
    if not st.S_ISREG(info.st_mode):
        kind = ("a directory" if st.S_ISDIR(info.st_mode) else "a FIFO" if st.S_ISFIFO(info.st_mode)
                else "a socket" if st.S_ISSOCK(info.st_mode) else "a device")
        raise HelmcError(f"{what}: expected a regular file, found {kind} at {path}")
    return info


def read_regular_file(path: str, what: str, limit: int = 256 << 20) -> bytes:
    """The bytes of the regular file at path (links followed), at most `limit` of them. A FIFO, device, socket or
    directory is refused before it is opened (opening a FIFO with no writer blocks forever; a device may never
    end), and the open itself does not block (O_NONBLOCK, in case the path is swapped between the two)."""
    import stat as st
    info = require_regular_file(path, what)
    if info.st_size > limit:
        raise HelmcError(f"{what}: expected at most {limit} bytes, found a file of {info.st_size} at {path}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not st.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise HelmcError(f"{what}: expected a regular file at {path}, found it replaced by something else")
            data = f.read(limit + 1)
    except OSError as e:
        raise HelmcError(f"{what}: could not read {path} ({e.strerror or e})") from None
    if len(data) > limit:
        raise HelmcError(f"{what}: expected at most {limit} bytes, found more at {path}")
    return data


def load_json_file(path: str, what: str) -> Any:
    try:
        return json.loads(read_regular_file(path, what).decode("utf-8"))
    except FileNotFoundError:
        raise HelmcError(f"{what}: file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise HelmcError(f"{what}: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise HelmcError(f"{what}: {path} is not valid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise HelmcError(f"{what}: {path} is not valid JSON of reasonable depth (nesting too deep)") from None
    except IsADirectoryError:
        raise HelmcError(f"{what}: expected a file, found a directory at {path}") from None
    except OSError as e:
        raise HelmcError(f"{what}: could not read {path} ({e.strerror or e})") from None
