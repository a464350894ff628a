"""`helmc run` streams its text to stdout as it decodes: what a reader of stdout gets is the one-shot decode of the
tokens (`--json`'s text), also when sampled tokens split characters into bytes. A real `helmc run` process on a
tiny Llama bundle."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = (1, 2, 3)


def run(*args):
    r = subprocess.run([sys.executable, "-m", "helmc.cli.main", "run", *args], capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.decode("utf-8")


def splits_a_character(tok, ids) -> bool:
    full = tok.decode(ids)
    return any((p := tok.decode(ids[:i])).endswith("\ufffd") and not full.startswith(p) for i in range(1, len(ids)))


def test_run_stdout_is_the_json_text(tiny):
    from tokenizers import Tokenizer
    bundle = tiny.bundle("llama")
    tok = Tokenizer.from_file(os.path.join(bundle, "tokenizer.json"))
    split = 0
    for seed in SEEDS:
        args = (bundle, "--prompt", "Once upon a time", "--temperature", "1", "--seed", str(seed),
                "--max-new-tokens", "64")
        result = json.loads(run(*args, "--json"))
        assert result["text"] == tok.decode(result["tokens"])
        assert run(*args) == result["text"], seed
        split += splits_a_character(tok, result["tokens"])
    assert split                     # at least one seed's tokens put a character over several tokens


def test_weights_resolve_from_the_current_directory(tiny, tmp_path):
    """--weights is a path like any other argument: relative to where helmc runs, not to the bundle."""
    bundle = tiny.bundle("llama")
    model_dir, _ = tiny.model("llama")
    args = ["-m", "helmc.cli.main", "run", bundle, "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json",
            "--weights", os.path.basename(model_dir)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run([sys.executable, *args], cwd=os.path.dirname(model_dir), capture_output=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr.decode()
    away = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert away.returncode == 2 and f"in {tmp_path / os.path.basename(model_dir)}," in away.stderr, away.stderr


def test_loading_prints_a_bar_on_a_terminal_and_nothing_through_a_pipe(tiny):
    """Weight binding: one line for all blocks on a terminal (no line per block); through a pipe only run's summary."""
    import pty
    bundle = tiny.bundle("llama")
    args = [sys.executable, "-m", "helmc.cli.main", "run", bundle, "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    piped = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert piped.returncode == 0 and piped.stderr.strip().count("\n") == 0, piped.stderr   # "[2 tokens, TTFT ...]"
    main, sub = pty.openpty()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=sub, env=env)
    os.close(sub)
    err = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:                      # the child closed its end
            break
        if not chunk:
            break
        err += chunk
    assert p.wait(timeout=300) == 0
    text = err.decode(errors="replace")
    assert text.count("binding the weights of 2 blocks: 2 done") == 1 and "weights: block" not in text, text
