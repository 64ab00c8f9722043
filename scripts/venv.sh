#!/usr/bin/env bash
# Create .venv at the repo root if missing and install epguard (editable) with its
# test dependencies. Re-installs only when pyproject.toml changed since last time.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
stamp=.venv/.epguard-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[test]'
    touch "$stamp"
fi
