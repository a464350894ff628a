"""The real CLI on bad input, and what it leaves: one typed line, its exit status, and the disk unchanged.

`cli` runs `helmc` in process through click's CliRunner (the same main() the console script calls), with stdout
and stderr apart. `refused` checks what a person sees: exit status 2, exactly one line from helmc, starting
"helmc: error:", holding every given fragment, and no traceback anywhere. `tree` is a snapshot of files (their
sha256), directories and links under some paths: equal snapshots before and after show nothing was written or lost.
"""
from __future__ import annotations

import hashlib
import os
import sys

from click.testing import CliRunner

from helmc.cli.main import main
from helmc.runtime.isolation import FORBIDDEN


def cli(*args, env: dict | None = None, input: str | None = None):
    # run / serve / chat block torch and onnx in sys.modules (runtime.isolation); in this shared process a later
    # test may need them, so what those commands changed there is put back.
    saved = {m: sys.modules.get(m, KeyError) for m in FORBIDDEN}
    try:
        r = CliRunner().invoke(main, [str(a) for a in args], env=env, input=input)
    finally:
        for m, mod in saved.items():
            if mod is KeyError:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod
    assert "Traceback" not in r.output, r.output
    return r


def helmc_lines(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("helmc:")]


def refused(r, *fragments, code: int = 2) -> str:
    """The one error line of a refused command, after checking its status and content."""
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    lines = helmc_lines(r)
    assert len(lines) == 1 and lines[0].startswith("helmc: error:"), r.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def tree(*roots) -> dict[str, str]:
    """path -> sha256 (files), 'dir', or '-> target' (links), for every entry under each root (a root may be a file)."""
    out = {}
    for root in map(str, roots):
        if not os.path.lexists(root):
            out[root] = "absent"
            continue
        entries = [root] if not os.path.isdir(root) or os.path.islink(root) else []
        for d, dirs, names in os.walk(root):
            entries += [os.path.join(d, n) for n in dirs + names]
            out[d] = "dir"
        for p in entries:
            if os.path.islink(p):
                out[p] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[p] = "dir"
    return out
