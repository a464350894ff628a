"""The tree shows the architecture: imports go one way, CLI -> API -> compiler / planner -> hardware ->
runtime -> model, with errors/jsonio under everything; no import cycle; no file over 600 lines. The import graph is read from the sources with `ast` (nothing is imported), counting
every import, also those inside functions: a lazy import is still a dependency."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Source folder -> the package it is installed as (pyproject's package-dir).
PACKAGE_DIRS = {"helmc": "helmc", "runtime": "helmc.runtime", "schedules": "helmc.schedules"}

# Layer of a module: the longest matching prefix. A module may import its own layer and the layers below it.
LAYERS = [
    ("helmc.cli", 7),
    ("helmc.api", 6), ("helmc", 6),                       # helmc/__init__ re-exports the API lazily
    ("helmc.compiler", 5), ("helmc.schedules", 5), ("helmc.testing", 5),
    ("helmc.planner", 4),
    ("helmc.hardware", 3),
    ("helmc.runtime", 2),
    ("helmc.model", 1),
    ("helmc.errors", 0), ("helmc.jsonio", 0),
]


def layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0]))
    return best


def modules() -> dict[str, str]:
    out = {}
    for folder, package in PACKAGE_DIRS.items():
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                    name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    out[name] = os.path.join(d, f)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not m.startswith(t + "."):    # a package's own __init__ is not a dependency
                    graph[m].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state, stack = {}, []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = 2
        return []

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return []


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found():
    # The checker itself: a graph with a cycle must be reported.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_imports_go_down_the_layers():
    upward = []
    for m, targets in import_graph().items():
        name, level = layer(m)
        for t in targets:
            t_name, t_level = layer(t)
            if t_level > level:
                upward.append(f"{m} ({name}) imports {t} ({t_name})")
    assert not upward, "\n".join(upward)


def test_the_cli_imports_only_the_api():
    # Every command parses its arguments and calls helmc.api (mlc-llm's thin CLI over a plain Python API): of helmc,
    # the CLI imports the API, the errors and its own modules, nothing deeper.
    allowed = ("helmc.api", "helmc.errors", "helmc.cli")
    deeper = [f"{m} imports {t}" for m, targets in import_graph().items() if m.startswith("helmc.cli.")
              for t in sorted(targets) if not any(t == a or t.startswith(a + ".") for a in allowed)]
    assert not deeper, "\n".join(deeper)


def test_runtime_never_imports_the_compiler_stack():
    bad = []
    for m, path in modules().items():
        if not m.startswith("helmc.runtime"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{m}: {n}" for n in names if n.split(".")[0] in ("torch", "onnx", "onnxscript")
                    or n.startswith(("tvm.relax", "tvm.s_tir", "tvm.topi", "helmc.compiler", "helmc.planner"))]
    assert not bad, bad


@pytest.mark.parametrize("top", ["helmc", "runtime", "schedules", "scripts", "tests", "benchmarks"])
def test_no_file_over_600_lines(top):
    # Files are split by job; a file past ~600 lines is holding more than one.
    long_files = []
    for d, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    n = sum(1 for _ in fh)
                if n > 600:
                    long_files.append(f"{os.path.relpath(os.path.join(d, f), ROOT)}: {n} lines")
    assert not long_files, long_files
