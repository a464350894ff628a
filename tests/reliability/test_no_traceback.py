"""No traceback reaches a person: an unexpected error in any command is one line naming it and the log file that
holds the traceback, exit status 1; `--debug` (or HELMC_DEBUG=1) prints the traceback instead. Expected errors
keep their typed line and status 2 (the catalogues check those)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from cli_check import cli, helmc_lines, tree

# command -> (what to break: module, attribute), (its arguments)
COMMANDS = {
    "build": (("helmc.api", "build"), lambda b, m, hw: ("build", m, hw, "-o", "out")),
    "run": (("helmc.api", "run"), lambda b, m, hw: ("run", b, "--prompt-ids", "1,2")),
    "plan": (("helmc.planner.search_partition", "plan"), lambda b, m, hw: ("plan", m, hw)),
    # the first thing `helmc profile` calls, so the test does not compile a profile kit first
    "profile": (("helmc.hardware.measure", "cpu_facts"), lambda b, m, hw: ("profile", "-o", "hw-out.json", "--quick")),
    "calibrate": (("helmc.planner.calibrate", "calibrate"), lambda b, m, hw: ("calibrate", b, hw, "-o", "cal.json")),
    "serve": (("helmc.runtime.serve.load", "load_engine"), lambda b, m, hw: ("serve", b, "--port", "0")),
    "chat": (("helmc.runtime.serve.load", "load_engine"), lambda b, m, hw: ("chat", b)),
    "keygen": (("helmc.runtime.bundle.signature", "generate_keypair"), lambda b, m, hw: ("keygen", "k")),
}


def _bug(*args, **kwargs):
    return {}["a key that is not there"]          # a KeyError, as a bug would raise


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unexpected_error_is_one_line_and_a_log(command, monkeypatch, tiny, hw_json, tmp_path, workdir):
    import importlib
    (module, attr), make_args = COMMANDS[command]
    args = make_args(tiny.bundle("qwen3"), tiny.model("qwen3")[0], hw_json)
    monkeypatch.setattr(importlib.import_module(module), attr, _bug)
    before = tree(workdir)
    r = cli(*args)
    assert r.exit_code == 1, r.output
    lines = helmc_lines(r)
    assert len(lines) == 1, r.output
    m = re.fullmatch(rf"helmc: internal error: KeyError: 'a key that is not there' in `helmc {command}` "
                     r"\(traceback in (\S+); rerun with --debug to see it\)", lines[0])
    assert m, lines[0]
    log = m.group(1)
    assert os.path.dirname(log) == str(tmp_path / "logs")
    text = open(log).read()
    assert "Traceback (most recent call last)" in text and "_bug" in text and "KeyError" in text
    assert tree(workdir) == before


@pytest.mark.parametrize("how", ["--debug", "HELMC_DEBUG=1"])
def test_debug_shows_the_traceback(how, monkeypatch, tiny, workdir):
    args = ("run", tiny.bundle("qwen3"), "--prompt-ids", "1,2")
    monkeypatch.setattr("helmc.api.run", _bug)
    if how == "--debug":
        r = _cli_allowing_traceback(("--debug",) + args)
    else:
        r = _cli_allowing_traceback(args, env={"HELMC_DEBUG": "1"})
    assert r.exit_code == 1
    assert "Traceback (most recent call last)" in r.stderr and "_bug" in r.stderr
    assert "internal error" not in r.stderr
    assert not (workdir.parent / "logs").exists()            # the traceback was shown, not logged


def _cli_allowing_traceback(args, env=None):
    from click.testing import CliRunner

    from helmc.cli.main import main
    from helmc.runtime.isolation import FORBIDDEN
    saved = {m: sys.modules[m] for m in FORBIDDEN if m in sys.modules}
    try:
        return CliRunner().invoke(main, [str(a) for a in args], env=env)
    finally:
        for m in FORBIDDEN:
            sys.modules.pop(m, None)
        sys.modules.update(saved)


def test_log_directory_unwritable_falls_back(monkeypatch, tiny, tmp_path, workdir):
    """A log directory that cannot be made: the traceback goes to the temporary directory instead, still one line."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HELMC_LOG_DIR", str(tmp_path / "file" / "logs"))
    bundle = tiny.bundle("qwen3")
    monkeypatch.setattr("helmc.api.run", _bug)
    r = cli("run", bundle, "--prompt-ids", "1,2")
    assert r.exit_code == 1 and len(helmc_lines(r)) == 1
    log = re.search(r"traceback in (\S+);", helmc_lines(r)[0]).group(1)
    assert "KeyError" in open(log).read()
    os.unlink(log)


def test_interrupt_is_one_line(monkeypatch, tiny, workdir):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    bundle = tiny.bundle("qwen3")
    monkeypatch.setattr("helmc.api.run", interrupted)
    r = cli("run", bundle, "--prompt-ids", "1,2")
    assert r.exit_code == 130 and helmc_lines(r) == ["helmc: interrupted"], r.output


def test_unexpected_error_in_a_real_process(tiny, tmp_path, workdir):
    """The console entry point in its own process: stdout empty, stderr one line, status 1."""
    code = ("import sys, helmc.api\n"
            "helmc.api.run = lambda *a, **k: [][1]\n"
            "from helmc.cli.main import main\n"
            "sys.argv[0] = 'helmc'\n"
            "main()\n")
    p = subprocess.run([sys.executable, "-c", code, "run", tiny.bundle("qwen3"), "--prompt-ids", "1,2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("helmc: internal error: IndexError: list index out of range in `helmc run`")
    assert "Traceback" not in p.stderr


def test_closed_stdout_ends_quietly(tiny, hw_json, workdir):
    """`helmc plan ... | head -1` where head has gone: no internal error and no traceback, status 141 (SIGPIPE's),
    nothing else on stderr. The reader closes its end before helmc writes (its start-up takes far longer)."""
    p = subprocess.Popen([sys.executable, "-m", "helmc.cli.main", "plan", tiny.model("qwen3")[0], str(hw_json)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "internal error" not in err and "Traceback" not in err and "BrokenPipe" not in err, err
