#!/usr/bin/env bash
# One command for the tests on a fresh machine: makes .venv, installs helmc, runs pytest.
#   scripts/test.sh          the fast tier (-m "not slow"): every layer, one real build + run against transformers
#   scripts/test.sh --all    every test (what CI runs)
# Two phases, one exit status: every test not marked `serial` on one pytest-xdist worker per core (a module's tests
# on one worker, so its fixtures build once; handed out in collection order, tests/conftest.py's LONG_MODULES_FIRST
# first, not xdist's most-tests-first), then the `serial` ones (they time the host) alone. Both share one
# artifact cache and host profile (HELMC_TEST_SHARED_DIR), so the serial phase recompiles nothing. The 25 slowest
# tests of each phase are listed. GPU tests skip cleanly where there is no GPU; other arguments go to pytest (test
# paths under tests/ instead of the whole suite).
# tests/conftest.py (SLOW_TESTS, SERIAL_TESTS) and @pytest.mark.slow say which tests are slow or serial.
# HELMC_TEST_WORKERS overrides the worker count (1: no xdist).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tier="not slow"
args=()
paths=(tests)            # the whole suite, unless test paths are given
for a in "$@"; do
    if [[ "$a" == "--all" ]]; then tier=""; else args+=("$a"); fi
    if [[ "$a" == tests/* ]]; then paths=(); fi
done
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
cd "$root"
cores="$(python -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${HELMC_TEST_WORKERS:-$(( cores < 8 ? cores : 8 ))}"
if ! python -c 'import xdist' 2>/dev/null; then
    echo "pytest-xdist is not installed: running the tests in one process" >&2
    workers=1
fi
shared="$(mktemp -d "${TMPDIR:-/tmp}/helmc-tests.XXXXXX")"
trap 'rm -rf "$shared"' EXIT
export HELMC_TEST_SHARED_DIR="$shared"
with_tier() { if [[ -n "$tier" ]]; then echo "($tier) and ($1)"; else echo "$1"; fi; }
# pytest's 5 is "no tests collected": a phase with nothing selected passes
phase() { local rc=0; python -m pytest -q -rs --durations=25 "$@" "${args[@]}" "${paths[@]}" || rc=$?; [[ $rc -eq 5 ]] && rc=0; return $rc; }
rc=0
if (( workers > 1 )); then
    echo "== tests on $workers workers (xdist, a module per worker) =="
    phase -n "$workers" --dist loadfile --no-loadscope-reorder -m "$(with_tier "not serial")" || rc=$?
    echo "== tests that time the host, alone =="
    phase -m "$(with_tier "serial")" || rc=$(( rc ? rc : $? ))
else
    phase ${tier:+-m "$tier"} || rc=$?
fi
exit "$rc"
