"""The command line's conventions, through click's runner (no bundle needed): -h everywhere, -o as --output on every
command that writes a file (--out still read where it was spelled so, not shown), and a model given where a bundle
belongs named as such, with the `helmc build` that makes one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from helmc.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = ("build", "run", "calibrate", "keygen", "profile", "plan", "serve", "chat")


@pytest.mark.parametrize("args", [()] + [(c,) for c in COMMANDS])
def test_dash_h_is_help(args):
    r = CliRunner().invoke(main, [*args, "-h"])
    assert r.exit_code == 0 and r.output.startswith("Usage: ") and "-h, --help" in r.output, r.output


@pytest.mark.parametrize("command", ["build", "calibrate", "profile", "plan"])
def test_dash_o_is_output(command):
    r = CliRunner().invoke(main, [command, "-h"])
    assert "-o, --output" in r.output and "--out " not in r.output and "--out," not in r.output


@pytest.mark.parametrize("spelling", ["-o", "--output", "--out"])
def test_build_reads_every_spelling_of_output(tmp_path, spelling):
    r = CliRunner().invoke(main, ["build", str(tmp_path / "missing-model"), "rtx4060-laptop", spelling,
                                  str(tmp_path / "b")])
    assert r.exit_code == 2 and "model: expected a Hugging Face model directory or a GGUF file" in r.output, r.output


@pytest.mark.parametrize("command", ["run", "serve", "chat", "calibrate"])
def test_a_model_where_a_bundle_belongs_says_build_it(tmp_path, command):
    """In a process of its own: run, serve and chat bar the compiler's imports from the process they run in."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    gguf = tmp_path / "m.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    cases = [(model, "a Hugging Face model directory", "my-model.bundle")]
    if command == "run":
        cases.append((gguf, "a GGUF file", "m.Q4_K_M.bundle"))
    for path, kind, out in cases:
        extra = {"run": ["--prompt-ids", "1"], "calibrate": ["rtx4060-laptop", "-o", str(tmp_path / "hw.json")]}
        r = subprocess.run([sys.executable, "-m", "helmc.cli.main", command, str(path), *extra.get(command, [])],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
        assert r.returncode == 2, r.stderr
        assert f"found {kind} at {path}; compile it first: helmc build {path} hardware.json -o {out}" in r.stderr


# A package that is not installed, as Python sees one: a finder first on sys.meta_path raises what the import system
# raises for a name it cannot find (loaded as sitecustomize, before helmc).
ABSENT = """import os, sys
names = set(os.environ["ABSENT_MODULES"].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
"""


@pytest.mark.parametrize("absent,args,line", [
    ("tvm", ("run", "{bundle}", "--prompt-ids", "1"), "helmc run needs the TVM runtime: pip install 'helmc[runtime]'"),
    ("tokenizers", ("run", "{bundle}", "--prompt-ids", "1"), "helmc run needs tokenizers: pip install 'helmc[runtime]'"),
    ("starlette", ("serve", "{bundle}"), "helmc serve needs starlette: pip install 'helmc[serve]'"),
    ("jinja2", ("chat", "{bundle}"), "helmc chat needs jinja2: pip install 'helmc[serve]'"),
    ("tvm", ("build", "{bundle}", "rtx4060-laptop", "-o", "{bundle}.out"),
     "helmc build needs the TVM compiler: pip install 'helmc[compile]'"),
])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, absent, args, line):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ABSENT)
    bundle = str(tmp_path / "some.bundle")
    r = subprocess.run([sys.executable, "-m", "helmc.cli.main", *(a.format(bundle=bundle) for a in args)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "ABSENT_MODULES": absent})
    assert r.returncode == 2 and r.stderr == line + "\n", r.stderr
