"""`helmc run` works with the TVM runtime library alone and never imports the compiler stack."""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import sys
from helmc.cli.main import main
sys.argv = ["helmc", "run", sys.argv[1], "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"]
try:
    main()
except SystemExit as e:
    assert e.code in (0, None), e.code
from helmc.runtime.isolation import compiler_modules_loaded
print("LOADED=" + ",".join(compiler_modules_loaded()))
"""


def test_run_in_runtime_only_mode_imports_no_compiler(tiny):
    bundle = tiny.bundle("qwen3")
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    p = subprocess.run([sys.executable, "-c", PROBE, bundle], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    result = json.loads(lines[0])
    assert len(result["tokens"]) == 3 and result["prompt_ids"] == [1, 2, 3]
    assert lines[-1] == "LOADED=", lines[-1]
