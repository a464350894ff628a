#!/usr/bin/env bash
# One command for the tests on a fresh machine: makes .venv, installs helmc, runs pytest.
# GPU tests skip cleanly where there is no GPU; extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
cd "$root"
python -m pytest -q -rs "$@" tests
