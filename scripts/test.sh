#!/usr/bin/env bash
# One command for the tests on a fresh machine: makes .venv, installs helmc, runs pytest.
#   scripts/test.sh          the fast tier (-m "not slow"): every layer, one real build + run against transformers
#   scripts/test.sh --all    every test (what CI runs)
# The 25 slowest tests are listed at the end. GPU tests skip cleanly where there is no GPU; other arguments go to
# pytest. tests/conftest.py (SLOW_TESTS) and @pytest.mark.slow say which tests are slow.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tier=(-m "not slow")
args=()
for a in "$@"; do
    if [[ "$a" == "--all" ]]; then tier=(); else args+=("$a"); fi
done
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
cd "$root"
python -m pytest -q -rs --durations=25 "${tier[@]}" "${args[@]}" tests
