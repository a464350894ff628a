"""A package of an optional extra that is not installed: one line naming the extra that brings it, not a traceback.

`pip install helmc` brings the command line alone; each job's packages come with an extra (pyproject.toml):
runtime (run a bundle), cuda (a bundle with a GPU stage), serve (serve, chat), gguf (read GGUF files), sign (signed
bundles), compile (build, profile; includes runtime).
"""
from __future__ import annotations

# top-level module -> (what it is, the extra that installs it)
_PROVIDERS = {
    "tvm": ("the TVM runtime", "runtime"), "numpy": ("NumPy", "runtime"), "tokenizers": ("tokenizers", "runtime"),
    "rich": ("rich", "runtime"), "cupy": ("CuPy (CUDA)", "cuda"), "cupy_backends": ("CuPy (CUDA)", "cuda"),
    "starlette": ("starlette", "serve"), "uvicorn": ("uvicorn", "serve"), "jinja2": ("jinja2", "serve"),
    "prometheus_client": ("prometheus_client", "serve"), "gguf": ("the gguf package", "gguf"),
    "cryptography": ("cryptography", "sign"), "torch": ("torch", "compile"), "onnx": ("onnx", "compile"),
    "onnxscript": ("onnxscript", "compile"),
}
_COMPILING = {"build", "profile"}          # commands whose TVM must be the compiler, not the runtime alone


def missing_extra_message(command: str | None, e: BaseException) -> str | None:
    """`helmc COMMAND needs X: pip install 'helmc[EXTRA]'` for an import of a package that is not installed; None
    for any other error (an import barred on purpose, runtime/isolation.py's, is a bug and says so elsewhere)."""
    if not isinstance(e, ModuleNotFoundError) or not e.name or "halted" in str(e):
        return None
    top = e.name.split(".")[0]
    if top not in _PROVIDERS:
        return None
    what, extra = _PROVIDERS[top]
    if top == "tvm" and command in _COMPILING:
        what, extra = "the TVM compiler", "compile"
    return f"helmc {command or ''} needs {what}: pip install 'helmc[{extra}]'".replace("helmc  needs", "helmc needs")


RUNTIME = ("tvm", "numpy", "tokenizers")


def need(*modules: str) -> None:
    """Stop now, before any file is read, if a package a command will import is not installed (found, not imported:
    no cost); main's error handling turns the ModuleNotFoundError into the line naming its extra."""
    from importlib.util import find_spec
    for m in modules:
        if find_spec(m) is None:
            raise ModuleNotFoundError(f"No module named {m!r}", name=m)
