"""The real console script on input a terminal can produce: prompt bytes that are not UTF-8 (one line, exit 2, no
traceback, no crash log), and Ctrl-C while TVM compiles (reported as an interruption, exit 130, nothing written)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

HELMC = os.path.join(os.path.dirname(sys.executable), "helmc")


def _lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("helmc:")]


@pytest.mark.parametrize("prompt", [b"\xff\xfe abc", b"caf\xe9", b"ok then \xed\xa0\x80 lone surrogate"])
def test_prompt_not_utf8(prompt, tiny, tmp_path, workdir):
    logs = tmp_path / "logs"
    r = subprocess.run([HELMC.encode(), b"run", tiny.bundle("qwen3").encode(), b"--prompt", prompt,
                        b"--max-new-tokens", b"2"], capture_output=True, timeout=300,
                       env=dict(os.environ, HELMC_LOG_DIR=str(logs)))
    err = r.stderr.decode("utf-8", "replace")
    lines = _lines(err)
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--prompt: expected UTF-8 text, found bytes that are not UTF-8" in lines[0]
    assert not logs.exists() or not os.listdir(logs)


def test_sigint_during_compile_is_an_interruption(tiny, hw_json, tmp_path, workdir):
    model, _ = tiny.model("qwen3")
    out = tmp_path / "bundle"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = subprocess.Popen([HELMC, "build", str(model), str(hw_json), "-o", str(out), "--no-cache"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, HELMC_LOG_DIR=str(tmp_path / "logs"), TMPDIR=str(scratch)),
                         # as from a terminal: a child inherits an ignored SIGINT (the whole suite's runner can have
                         # one), and Python then installs no KeyboardInterrupt handler
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # progress lines go to a terminal only: the build's scratch directory (pipeline.build's helmc-build-*) says
    # that compiling has begun, which takes seconds more whatever the machine's speed
    seen, deadline = "", time.monotonic() + 120
    while not any(d.name.startswith("helmc-build-") for d in scratch.iterdir()):
        assert p.poll() is None and time.monotonic() < deadline, "the build ended or stalled before compiling"
        time.sleep(0.05)
    time.sleep(0.5)
    assert p.poll() is None, "the build ended before the interrupt"
    p.send_signal(signal.SIGINT)
    stdout, rest = p.communicate(timeout=300)
    err = seen + rest
    assert p.returncode == 130, (p.returncode, err)
    assert _lines(err) == ["helmc: interrupted"], err
    assert "internal error" not in err and "Traceback" not in err
    assert not out.exists()


def test_ctrl_c_inside_onnx_callbacks_waits_until_the_stack_leaves_them():
    """A KeyboardInterrupt raised in Python code that onnx's native library called would abort the process; the
    handler defers it and raises it at the next Python frame outside those modules."""
    from helmc.cli import main
    previous = signal.signal(signal.SIGINT, main._on_sigint)
    try:
        main._SIGINT_SEEN.clear()
        # a frame of an onnx module, as the ONNX export's callbacks run: the handler returns, nothing raised
        exec(compile("handler(signal.SIGINT, sys._getframe())", "<onnx callback>", "exec"),
             {"__name__": "onnx.helper", "handler": main._on_sigint, "signal": signal, "sys": sys})
        assert len(main._SIGINT_SEEN) == 1
        # back in this module: the interrupt is delivered again, now as a KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert len(main._SIGINT_SEEN) == 2
        # and outside those modules it is raised at once
        with pytest.raises(KeyboardInterrupt):
            main._on_sigint(signal.SIGINT, sys._getframe())
    finally:
        signal.signal(signal.SIGINT, previous)
        main._SIGINT_SEEN.clear()
