"""Kernel writing without rescanning every loaded module per stack frame.

TVMScript's parser walks the whole call stack (inspect.getouterframes) for every prim_func and for most T.* calls in
one, and inspect.getmodule, asked for a frame whose file is no module's (the parser's evaluated "<ast>" code,
"<frozen runpy>"), scans all of sys.modules each time: ~2,400 modules in a build process, which imports torch and
onnx for the export. That scan was most of a kernel's parse time (a Qwen3-8B fp16 build ~10% faster without it, the
quantized kernels' tests about twice as fast). For such a frame Python's answer is None until a module with that file
is imported, so it is remembered while the count of loaded modules stays the same; an import asks again. Every other
question goes to inspect.getmodule itself, and nothing TVM computes changes.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Callable, Iterator


def remember_frames_of_no_module() -> Callable[[], None]:
    """Install the remembered answer into inspect.getmodule; returns the function that puts Python's back."""
    scan = inspect.getmodule
    no_module: dict[str, int] = {}

    def getmodule(obj, _filename=None):
        if _filename is None or hasattr(obj, "__module__") or not inspect.isframe(obj):
            return scan(obj, _filename)
        if no_module.get(_filename) == len(sys.modules):
            return None
        found = scan(obj, _filename)
        if found is None:
            no_module[_filename] = len(sys.modules)
        return found

    inspect.getmodule = getmodule

    def restore() -> None:
        inspect.getmodule = scan
    return restore


@contextlib.contextmanager
def frames_of_no_module_remembered() -> Iterator[None]:
    """remember_frames_of_no_module() for the duration of a build."""
    restore = remember_frames_of_no_module()
    try:
        yield
    finally:
        restore()
