"""Keep the compiler stack out of a runtime process.

tvm_ffi imports torch eagerly whenever torch is installed (a workaround for a symbol clash on one
Windows configuration), which costs seconds of start-up and breaks the rule that the runtime never
imports torch. `helmc run` calls forbid_compiler_imports() before the first TVM import: torch and
onnx then fail to import, which tvm_ffi tolerates. Library users who also want torch in the same
process (the benchmark scripts running Hugging Face peers) simply do not call it.
"""
from __future__ import annotations

import sys

FORBIDDEN = ("torch", "onnx", "onnxscript")


def forbid_compiler_imports() -> None:
    for name in FORBIDDEN:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # import now raises ImportError


def compiler_modules_loaded() -> list[str]:
    """Parts of the compiler stack present in this process (for tests and diagnostics): torch, onnx,
    the Relax / schedule packages, and TVM's compiler library. (`import tvm.runtime` itself pulls in
    TVM's thin Python wrappers tvm.te, tvm.tirx and tvm.driver, which need no compiler library and are not counted.)"""
    out = []
    for m, mod in sys.modules.items():
        if mod is None:
            continue
        if m.split(".")[0] in FORBIDDEN or m.startswith(("tvm.relax", "tvm.s_tir", "tvm.topi")):
            out.append(m)
    try:
        with open("/proc/self/maps") as f:
            if "libtvm_compiler" in f.read():
                out.append("libtvm_compiler.so")
    except OSError:
        pass
    return sorted(out)
