#!/usr/bin/env bash
# Creates .venv (if missing) and installs helmc with the compiler, serving, signing and test extras.
# torch is installed first, pinned to 2.13.0: on these machines that resolves to a local CPU wheel,
# while an unpinned torch would pull several GB of CUDA wheels. Sourced by demo.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HELMC_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.helmc-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  python -m pip install -q -e "$root[compile,serve,sign,test]"
  touch "$stamp"
fi
