"""What every process of one test run shares (scripts/test.sh's xdist workers and its serial phase): a directory and
a lock in it. A module of its own: `from conftest import` names whichever conftest a worker imported first."""
from __future__ import annotations

import contextlib
import fcntl
import os


def shared_dir(tmp_path_factory) -> str:
    """A directory every process of this test run shares: HELMC_TEST_SHARED_DIR (scripts/test.sh gives its parallel
    and serial phases one), else the xdist workers' common temporary root, else this session's own."""
    env = os.environ.get("HELMC_TEST_SHARED_DIR")
    if env:
        os.makedirs(env, exist_ok=True)
        return env
    base = tmp_path_factory.getbasetemp()
    return str(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@contextlib.contextmanager
def run_lock(tmp_path_factory, name: str):
    """Held by one process of the test run at a time: the first makes what the others then reuse."""
    with open(os.path.join(shared_dir(tmp_path_factory), f".{name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
